"""``torch.export`` of a user's model, with errors a user can act on: the exception's first
meaningful lines, the model's own source line, and what to change (never the partial graph dump
that ``torch.export`` prints on failure)."""
from __future__ import annotations

import contextlib
import inspect
import io
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .assigned import submodule_assignments
from .segments import NotSegments, fixed_segments
from .branches import DECIDED, data_dependent, needs_values, specialising, unchecked
from .checkpoints import refusal, watch_checkpoints
from .functions import refusal as function_refusal
from .leaves import make_leaves, unregistered


class TraceError(ValueError):
    """The model cannot be traced as given (bad sample arguments, or export failed)."""


MAX_LINES = 3  # of the exception's own message
_NOISE = re.compile(r"^(For more information|For extended logs|If you suspect|For more debugging help|For C\+\+ "
                    r"stack trace|Caused by:|The error above occurred|consider using data-dependent|"
                    r"The following call raised)")
_CALL = re.compile(r'The following call raised this error:\n\s*File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')

# what to change, by the kind of failure (matched against the exception's type and message)
HINTS = (
    (re.compile(r"data-dependent|GuardOnDataDependent|DataDependent", re.I),
     "the model branches on, or turns into a Python number, a value computed from its inputs; "
     "write it with tensor ops (torch.where, masks, torch.cond) or move it out of forward"),
    (re.compile(r"Unsupported|not supported|NotImplemented", re.I),
     "the model calls something torch.export cannot record; replace it with torch operators or wrap "
     "it as a torch.library.custom_op with a dimops annotation (nnscaler.register_op)"),
    (re.compile(r"dynamic|Constraint|guard", re.I),
     "the model depends on a value torch.export cannot fix at trace time; make it a constant of the "
     "model or a tensor operation"),
)
DEFAULT_HINT = ("make forward traceable by torch.export.export(model, args, strict=False): tensor "
                "operations only, no Python logic on tensor values")


def _torch_or_ours(filename: str) -> bool:
    own = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
    return filename.startswith(own) or "/lib/python" in filename and "site-packages" not in filename \
        or filename.startswith("<")


def model_line(exc: BaseException) -> str:
    """``file:line in function: code`` of the model's own line that failed: the call torch.export
    names in its message, else the innermost traceback frame outside torch, nnscaler and the
    standard library (a library model's own file, such as transformers', counts as the model's)."""
    m = _CALL.search(str(exc))
    if m:
        return f"{m.group(1)}:{m.group(2)} in {m.group(3)}: {m.group(4).strip()}"
    user = [f for f in traceback.extract_tb(exc.__traceback__) if not _torch_or_ours(f.filename)]
    if not user:
        return ""
    f = user[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def first_lines(exc: BaseException, limit: int = MAX_LINES) -> str:
    """The exception's first meaningful lines: no blank lines, torch's debugging advice, graph dumps."""
    lines = []
    for line in str(exc).strip().splitlines():
        line = line.strip()
        if not line or _NOISE.match(line):
            continue
        if line.startswith(("def forward", "class GraphModule", "File \"", "#")):
            break
        lines.append(line)
        if len(lines) == limit:
            break
    return " ".join(lines)


def hint(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return next((h for pattern, h in HINTS if pattern.search(text)), DEFAULT_HINT)


def check_arguments(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`TraceError` unless ``model.forward`` accepts these sample arguments."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise TraceError(f"sample arguments do not match {type(model).__name__}.forward{sig}: {exc}") from None


def _mutates(ep) -> bool:
    """Whether any operator of the exported program writes into a tensor in place."""
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)


SET_GRAD_ENABLED = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)  # a torch.no_grad() region
NO_GRAD = "nnscaler_no_grad"  # node.meta key: the node ran under torch.no_grad() (set by :func:`functional`)


_GENERATED = re.compile(r'File "<eval_with_key>[^"]*", line \d+, in \S+\n\s*(\w+) = ')


def _from_region(node: torch.fx.Node, regions: dict) -> str | None:
    """The one of ``regions`` (by ``(name, graph id)``) ``node`` was decomposed from, followed
    through ``node.meta["from_node"]``; ``None`` if none."""
    todo = list(node.meta.get("from_node") or ())
    while todo:
        src = todo.pop()
        key = (getattr(src, "name", None), getattr(src, "graph_id", None))
        if key in regions:
            return key[0]
        todo += list(getattr(src, "from_node", None) or ())
    return None


def _region_traces(ep) -> dict:
    """``(region, node name) -> stack_trace`` of the nodes inside each ``torch.no_grad()`` region of
    ``ep`` (the model's own lines, which the decomposed nodes lose for the region's generated code)."""
    out = {}
    for n in ep.graph.nodes:
        if SET_GRAD_ENABLED is not None and n.target is SET_GRAD_ENABLED and not n.args[0]:
            sub = getattr(ep.graph_module, str(n.args[1].target), None)
            for inner in (sub.graph.nodes if isinstance(sub, torch.fx.GraphModule) else ()):
                if inner.meta.get("stack_trace"):
                    out[(n.name, inner.name)] = inner.meta["stack_trace"]
    return out


def functional(ep):
    """``ep`` with in-place writes (``t[..., 0] = x``: ``select`` then ``fill_``; a buffer's
    ``mul_``/``add_``/``copy_``) replaced by their functional forms (``select_scatter``; a buffer's new
    value, an output of kind ``BUFFER_MUTATION``), which a partitioned program can compute shard by
    shard; a write into a view would otherwise be lost once the view is converted to another layout.
    Programs without such writes are returned as they are. ``run_decompositions`` inlines the
    ``torch.no_grad()`` regions: their nodes are marked ``meta[NO_GRAD]`` (from ``from_node``), so the
    trace still cuts their gradient. It also turns ``reshape`` into ``view``, valid on the whole
    tensor but not on every shard a plan makes of it, so views are traced back to ``reshape`` (equal
    wherever ``view`` is valid)."""
    if not _mutates(ep):
        return ep
    regions = {(n.name, id(n.graph)): n for n in ep.graph.nodes
               if SET_GRAD_ENABLED is not None and n.target is SET_GRAD_ENABLED and not n.args[0]}
    traces = _region_traces(ep)
    with warnings.catch_warnings():  # torch's own pytree deprecation notice, nothing of the user's
        warnings.simplefilter("ignore", FutureWarning)
        ep = ep.run_decompositions({})
    if regions:
        for node in ep.graph.nodes:
            region = _from_region(node, regions) if node.op == "call_function" else None
            if region is not None:
                node.meta[NO_GRAD] = True
                inner = _GENERATED.findall(node.meta.get("stack_trace") or "")
                if inner and (region, inner[-1]) in traces:  # the model's line, not the region's code
                    node.meta["stack_trace"] = traces[(region, inner[-1])]
    for node in ep.graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    ep.graph_module.recompile()
    return ep


@contextlib.contextmanager
def rewritten(model: torch.nn.Module, rewrites: Sequence) -> Any:
    """Within: each module of ``model`` that one of ``rewrites`` (``rewrite(module) -> forward | None``,
    :meth:`OpRegistry.add_module_rewrite`) answers for runs that forward; restored on exit."""
    done = []
    try:
        for module in model.modules():
            for rewrite in rewrites:
                forward = rewrite(module)
                if forward is not None:
                    had = "forward" in vars(module)
                    done.append((module, had, vars(module).get("forward")))
                    module.forward = forward
                    break
        yield
    finally:
        for module, had, old in reversed(done):
            if had:
                module.forward = old
            else:
                del module.forward


def _export(model: torch.nn.Module, args: Sequence[Any], kwargs: dict):
    """``torch.export.export`` (non-strict) with splits by data-made sizes traced fixed-shape
    (:mod:`.segments`), or as written where a segment meets an operator that is not row-wise."""
    try:
        with fixed_segments(), submodule_assignments(model):
            return torch.export.export(model, tuple(args), kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001  (torch may wrap it: the cause chain says)
        seen = exc
        while seen is not None and not isinstance(seen, NotSegments):
            seen = seen.__cause__ or seen.__context__
        if seen is None:
            raise
    with submodule_assignments(model):
        return torch.export.export(model, tuple(args), kwargs, strict=False)


def export_model(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
                 rewrites: Sequence = (), leaves: bool = True):
    """``torch.export.export(model, args, kwargs, strict=False)`` (with the module ``rewrites`` of
    :func:`rewritten`); a failure becomes a :class:`TraceError` naming the model, the exception's
    first lines, the model's source line and what to change. With ``leaves``, the model's
    unregistered ``torch.autograd.Function``s are made leaves with inferred annotations
    (:mod:`.leaves`) and the model traced again."""
    kwargs = dict(kwargs or {})
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"parallelize needs a torch.nn.Module, got {type(model).__name__}")
    check_arguments(model, args, kwargs)
    # torch.export prints the partial graph of a failed trace to stderr (thousands of lines for a
    # real model); capture stderr while it runs and pass on everything but that dump
    captured = io.StringIO()
    checkpoints: list[str] = []  # torch.utils.checkpoint calls of the model: recompute regions (.checkpoints)
    try:
        with contextlib.redirect_stderr(captured), watch_checkpoints(checkpoints), rewritten(model, rewrites):
            first = None  # torch.export's own data-dependent error: what a model it cannot specialise ends with
            try:
                ep = _export(model, args, kwargs)
                again = needs_values(ep)  # data-dependent sizes: the plan takes the sample's (.branches)
            except Exception as exc:  # noqa: BLE001  (a guard on data: decided on the sample, checked at run time)
                if not data_dependent(exc):
                    raise
                again, first = True, exc
            if again:
                dump = captured.getvalue()
                captured.seek(0)
                captured.truncate()  # (the first try's partial graph is no news if this one works)
                checkpoints.clear()
                try:
                    with specialising() as decided:
                        ep = _export(model, args, kwargs)
                except Exception:  # noqa: BLE001  (torch's real-tensor trace failing: the first error says more)
                    if first is None:
                        raise
                    captured.write(dump)
                    raise first from None
                ep.graph_module.meta[DECIDED] = list(decided)
                silent = unchecked(ep, decided)
                if silent:  # a data-dependent choice the program could not check: refused, never silent
                    if first is not None:
                        captured.write(dump)
                        raise first from None
                    raise TraceError(f"torch.export cannot trace {type(model).__name__} for every input: {silent}; "
                                     f"to fix: {HINTS[0][1]}")
    except TraceError:
        raise
    except Exception as exc:
        dump = str(getattr(exc, "partial_fx_graph", "") or "")
        text = captured.getvalue()
        captured = io.StringIO(text.replace(dump, "") if dump else text)
        where = model_line(exc)
        raise TraceError(f"torch.export cannot trace {type(model).__name__}: {type(exc).__name__}: "
                         f"{first_lines(exc)}" + (f" (at {where})" if where else "") + f"; to fix: {hint(exc)}"
                         ) from exc
    finally:
        rest = captured.getvalue().strip()
        if rest:
            print(rest, file=sys.stderr)
    reentrant = refusal(model, checkpoints)  # a reentrant one (the non-reentrant ones are recompute regions)
    if reentrant:
        raise TraceError(reentrant)
    classes = unregistered(ep.graph)  # one scan: made leaves, or (after that) refused
    if classes and leaves:
        with rewritten(model, rewrites):
            refused = make_leaves(model, args, kwargs, classes)
        if refused:
            raise TraceError(refused)
        return export_model(model, args, kwargs, rewrites, leaves=False)  # each is one operator now
    if classes:
        raise TraceError(function_refusal(*next(iter(classes.items()))))
    return functional(ep)
