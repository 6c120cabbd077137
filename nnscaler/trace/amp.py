"""What ``torch.autocast`` would do to each operator of a traced program, recorded at trace time so
that a ``bf16-mixed`` program can do the same with explicit casts (``ComputeConfig(precision=...)``).

``torch.export`` traces above autocast (an ``autocast`` around the export leaves no trace in the
graph), and a partitioned program calls other kernels than the single device does (a vocabulary-
parallel cross-entropy is a handful of elementwise ops that autocast leaves in bf16 where it runs
``cross_entropy_loss`` in fp32). So each operator is run once on fake tensors, under autocast and
without it, on the dtypes the autocast run propagated: where the two disagree (or only autocast can
run it, as ``linear`` of a bf16 input and an fp32 weight), autocast cast the floating inputs, to the
dtype of the autocast result (bf16 for its lower-precision ops, fp32 for its fp32 ops, the widest
for its promote ops). The generated program casts exactly those operators' floating inputs to that
dtype and runs with autocast off, so every operator computes in the dtype it computes in on one
device under autocast, whatever kernel carries it out.

The fp32 trace also baked the Python values a model computes from a tensor's dtype: ``masked_fill(s,
mask, torch.finfo(s.dtype).min)`` holds float32's lowest, -3.4028e38, where under autocast ``s`` is bf16
and the model asks for bf16's, -3.3895e38 (float32's does not even convert to bf16: the program would
stop with an overflow). So an operator computing in bf16 that holds float32's ``+-finfo.max`` gets
bf16's instead (:func:`autocast_casts`'s second result); other constants are left as traced.

It also lost the model's conversions to float32 (``softmax(router_logits.float())``): on an fp32
tensor ``.float()`` is a no-op, which ``torch.export`` keeps only as a dtype assert while the users of
its result read the tensor itself. Under autocast that tensor may be bf16 and the conversion real, so
the program converts it where the assert stands, for every operator after it (the emitter's
``converted``), and the fake run here does the same. An operator after it that the model meant to
read the unconverted tensor then computes in the wider dtype: more precise than the model, never
less (Mixtral's router softmax and top-k ran in bf16 without it: routing flipped for tokens near a
tie, and the router's gradient was 13% off the single-device run's)."""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_leaves, tree_map

_SET_GRAD_ENABLED = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
CASTABLE = (torch.float32, torch.bfloat16, torch.float16)  # autocast leaves float64 alone


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in CASTABLE


def asserted_dtype(target, args, kwargs) -> torch.dtype | None:
    """The floating dtype an ``aten._assert_tensor_metadata`` call asserts (its fourth argument, or
    ``dtype=``), else None."""
    if "assert_tensor_metadata" not in str(target):
        return None
    dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def converts_to(target, args, kwargs) -> torch.dtype | None:
    """The wider dtype (float32 or float64) a dtype assert of the fp32 trace stands for a conversion
    to under bf16-mixed (module docstring), else None."""
    dtype = asserted_dtype(target, args, kwargs)
    return dtype if dtype in (torch.float32, torch.float64) else None


def _first_float_dtype(out: Any) -> torch.dtype | None:
    return next((t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def autocast_casts(ep, device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16
                   ) -> tuple[dict[str, Any], dict[str, dict[float, float]]]:
    """``{op name: dtype}`` (or ``"drop"`` for an assert of a floating dtype) for every operator of the exported program ``ep`` whose floating inputs
    ``torch.autocast(device_type, dtype)`` casts, named as :func:`nnscaler.trace.build.trace` names
    them (regions under a grad-mode switch prefixed by their node's name); and ``{op name: {traced
    constant: constant}}`` for the operators computing in ``dtype`` that hold float32's extremes
    (module docstring)."""
    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"]
    fake = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    casts: dict[str, torch.dtype] = {}
    literals: dict[str, dict[float, float]] = {}
    if fake is None:
        return casts, literals

    def visit(graph: torch.fx.Graph, env: dict, prefix: str) -> list:
        def value(a):
            return tree_map(lambda x: env.get(x) if isinstance(x, torch.fx.Node) else x, a)
        for node in graph.nodes:
            if node.op == "placeholder":
                if node not in env:
                    env[node] = node.meta.get("val")
            elif node.op == "get_attr":
                env[node] = getattr(ep.graph_module, node.target, None)
            elif node.op == "call_function" and node.target is operator.getitem:
                base = env.get(node.args[0])
                env[node] = None if base is None else base[node.args[1]]
            elif node.op == "call_function" and node.target is _SET_GRAD_ENABLED:
                sub = env[node.args[1]]
                sub_env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], value(node.args[2:])))
                env[node] = visit(sub.graph, sub_env, f"{prefix}{node.name}_")
            elif node.op == "call_function":
                env[node] = _run(node, value(node.args), value(node.kwargs), f"{prefix}{node.name}")
                dtype = converts_to(node.target, node.args, node.kwargs)
                if dtype is not None and isinstance(node.args[0], torch.fx.Node) and _floating(env.get(node.args[0])):
                    env[node.args[0]] = env[node.args[0]].to(dtype)  # as the emitter converts it
            elif node.op == "output":
                return list(value(node.args[0]))
        return []

    def _run(node, args, kwargs, name):
        if "_assert" in str(node.target):  # metadata asserts of the fp32 trace: nothing to compute
            if asserted_dtype(node.target, args, kwargs) is not None:
                casts[name] = "drop"  # asserts the fp32 trace's dtype, which the recipe changes
            return None
        with torch.autocast(device_type, dtype=dtype):
            out = node.target(*args, **kwargs)
        if not any(_floating(x) for x in tree_leaves((args, kwargs))):
            return out
        cast = _autocast_class(node.target, args, kwargs)
        if cast is not None:
            casts[name] = cast
        computes = cast if cast is not None else next(x.dtype for x in tree_leaves((args, kwargs)) if _floating(x))
        if computes == dtype:
            top, low = torch.finfo(torch.float32).max, torch.finfo(dtype).max
            held = {x for x in tree_leaves((node.args, node.kwargs)) if isinstance(x, float) and abs(x) == top}
            if held:
                literals[name] = {x: low if x > 0 else -low for x in held}
        return out

    def _autocast_class(target, args, kwargs):
        """bf16 where autocast runs ``target`` in ``dtype`` (fp32 floating inputs give a ``dtype``
        result), fp32 where it runs it in fp32 (``dtype`` inputs give an fp32 result), else None."""
        def uniform(dt):
            a, k = tree_map(lambda x: x.to(dt) if _floating(x) else x, (args, kwargs))
            try:
                with torch.autocast(device_type, dtype=dtype):
                    return _first_float_dtype(target(*a, **k))
            except Exception:  # noqa: BLE001 (an op that takes no such inputs: not one autocast casts)
                return None
        if uniform(torch.float32) == dtype:
            return dtype
        if uniform(dtype) == torch.float32:
            return torch.float32
        return None

    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a call only autocast makes valid fails loudly without it
    try:
        with fake, torch.no_grad():
            visit(ep.graph, {}, "")
    finally:
        quiet.setLevel(level)
    return casts, literals
