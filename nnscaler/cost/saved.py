"""What autograd keeps for backward, per operator, learnt from torch itself: each operator of the
traced program is run once on fake tensors with gradients on (the parameters requiring them, the
``bf16-mixed`` casts applied as the generated program applies them) under
``torch.autograd.graph.saved_tensors_hooks``, and each tensor it saves is named by where its storage
came from: one of its inputs (a parameter's cast, made once, included), one of its outputs, or a
tensor the kernel made itself (layer norm's mean and rstd, attention's log-sum-exp). A per-operator
table written by hand would miss what each kernel and its decompositions actually save (a fused
``linear`` saves its input, an ``addmm`` after ``t`` saves it too, a softmax saves its output, a
``gelu`` its input); this asks the autograd engine the measured run will use.

:func:`saved_bytes` turns that into a plan's per-rank bytes (:mod:`nnscaler.cost.estimate`): a
storage saved by several operators counts once (views share their base's), a tensor a conversion
re-lays for its consumer counts at the consumer's layout, and under recompute an operator inside a
recomputed region keeps nothing while the region keeps its inputs (``torch.utils.checkpoint``,
non-reentrant), as :class:`nnscaler.runtime.recompute.SavedActivations` measures it.
"""
from __future__ import annotations

import contextlib
import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_leaves, tree_map

from ..ir.graph import PARAM, IRGraph, IRTensor
from ..runtime.precision import tensors_device_type
from ..trace.amp import converts_to
from .steps import local_nbytes, nbytes

_SET_GRAD_ENABLED = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


@dataclass(frozen=True)
class Saved:
    """One storage an operator saves: ``tensor`` (an IR tensor it reads, ``read=True``, or makes) or,
    where ``tensor`` is None, ``nbytes`` of a tensor the kernel made (scaled under a plan as the
    operator's ``like`` tensor is); ``cast``: a read input cast to this dtype first."""

    tensor: IRTensor | None
    read: bool = False
    nbytes: int = 0
    like: IRTensor | None = None
    cast: Any = None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: views share it (no public accessor on fake tensors)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage as a plain int (a fake tensor may hold a symbolic size: 0 when no hint)."""
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 (an unbacked symbolic size: nothing the estimate can count)
        return 0


def saved_per_op(graph: IRGraph) -> tuple[dict[str, list[Saved]], dict[str, IRTensor], dict[str, int]]:
    """``{op name: what it saves}`` for every operator of ``graph`` (module docstring; an operator
    saving nothing, or that cannot run on fake tensors, is left out) and ``{tensor name: the tensor
    whose storage it is}`` (a view's base) and ``{tensor name: bytes of its storage}`` as the program
    makes it (a ``bf16-mixed`` linear's output is bf16 where the trace has float32). Cached on the export program per set of casts (one fake
    run per trace and precision, shared by the graph's copies)."""
    ep = graph.exported
    if ep is None:
        return {}, {}, {}
    casts = {op.name: op.cast for op in graph.ops if op.cast is not None}
    key = tuple(sorted((k, str(v)) for k, v in casts.items()))
    cache = ep.__dict__.setdefault("_nnscaler_saved", {})
    if key not in cache:
        cache[key] = _run(graph, casts)
    per_op, alias, sizes = cache[key]
    # the cache holds the tensors of the graph that filled it; a copy (graph.copy()) has its own, by name
    cur = {t.name: t for t in graph.inputs + graph.params + graph.buffers}
    cur.update({t.name: t for op in graph.ops for t in op.outputs if t is not None})
    here = lambda t: cur.get(t.name, t) if t is not None else None  # noqa: E731
    return ({n: [Saved(here(x.tensor), x.read, x.nbytes, here(x.like), x.cast) for x in xs] for n, xs in per_op.items()},
            {n: here(t) for n, t in alias.items()}, sizes)


def _device(args) -> str:
    """The device type autocast names for ``args`` (a meta trace plans for a GPU: ``cuda``)."""
    kind = tensors_device_type(tree_leaves(args))
    return kind if kind in ("cpu", "cuda") else "cuda"


def _run(graph: IRGraph, casts: dict[str, Any]) -> tuple[dict[str, list[Saved]], dict[str, IRTensor], dict[str, int]]:
    ep = graph.exported
    ir = {t.name: t for t in graph.inputs + graph.params + graph.buffers}
    ir.update({t.name: t for op in graph.ops for t in op.outputs if t is not None})
    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"]
    fake = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    out: dict[str, list[Saved]] = {}
    alias: dict[str, IRTensor] = {}
    sizes: dict[str, int] = {}
    if fake is None:
        return out, alias, sizes
    roots: dict[int, IRTensor] = {}  # storage -> the IR tensor that made it
    param_casts: dict[tuple[str, str], torch.Tensor] = {}
    fakes: dict[str, torch.Tensor] = {}  # IR tensor name -> its fake value
    ops = {op.name: op for op in graph.ops}

    def bind(val, t):
        if isinstance(val, torch.Tensor) and isinstance(t, IRTensor):
            alias[t.name] = roots.setdefault(_storage(val), t)
            fakes[t.name] = val
            sizes[t.name] = _nbytes(val)

    def visit(g: torch.fx.Graph, env: dict, prefix: str, grad: bool) -> list:
        def value(a):
            return tree_map(lambda x: env[x][0] if isinstance(x, torch.fx.Node) else x, a)

        def irv(a):
            return tree_map(lambda x: env[x][1] if isinstance(x, torch.fx.Node) else None, a)

        for node in g.nodes:
            if node.op == "placeholder":
                if node not in env:
                    v, t = node.meta.get("val"), ir.get(node.name)
                    if isinstance(v, torch.Tensor) and t is not None and t.kind == PARAM and v.is_floating_point():
                        v = v.detach().requires_grad_(True)
                    env[node] = (v, t)
                    bind(v, t)
            elif node.op == "get_attr":
                env[node] = (getattr(ep.graph_module, node.target, None), None)
            elif node.op == "call_function" and node.target is operator.getitem:
                v, t = env[node.args[0]]
                env[node] = (None if v is None else v[node.args[1]],
                             t[node.args[1]] if isinstance(t, (list, tuple)) else None)
            elif node.op == "call_function" and node.target is _SET_GRAD_ENABLED:
                sub = env[node.args[1]][0]
                sub_env = {n: env[a] if isinstance(a, torch.fx.Node) else (a, None)
                           for n, a in zip([n for n in sub.graph.nodes if n.op == "placeholder"], node.args[2:])}
                res = visit(sub.graph, sub_env, f"{prefix}{node.name}_", bool(node.args[0]))
                env[node] = ([r[0] for r in res], [r[1] for r in res])
            elif node.op == "call_function":
                name = f"{prefix}{node.name}"
                metas = node.meta.get("val")
                many = isinstance(metas, (list, tuple))
                ts = [ir.get(f"{name}_{i}") for i in range(len(metas))] if many else [ir.get(name)]
                v = call(node, name, value(node.args), value(node.kwargs), irv(node.args), irv(node.kwargs), grad, ts)
                env[node] = (v, ts) if many else (v, ts[0])
                dtype = converts_to(node.target, node.args, node.kwargs) if casts.get(name) == "drop" else None
                x = env.get(node.args[0]) if dtype is not None else None
                if x is not None and isinstance(x[0], torch.Tensor) and x[0].dtype in (torch.bfloat16, torch.float16):
                    with torch.set_grad_enabled(grad):  # the model's conversion, as the emitter makes it
                        y = x[0].to(dtype)
                    if x[1] is not None:
                        roots.setdefault(_storage(y), x[1])
                    env[node.args[0]] = (y, x[1])
            elif node.op == "output":
                return [env[a] if isinstance(a, torch.fx.Node) else (a, None) for a in node.args[0]]
        return []

    def call(node, name, args, kwargs, irargs, irkwargs, grad, ts):
        cast = casts.get(name)
        if cast == "drop" or "_assert" in str(node.target):
            return None
        inside = torch.autocast(_device(args), dtype=torch.bfloat16) if cast == "autocast" else contextlib.nullcontext()
        cast = None if cast == "autocast" else cast  # a custom operator: run under autocast, inputs as they are
        none = lambda x: x is None  # noqa: E731 (pytree drops None: keep both sides aligned)
        leaves, irleaves = tree_leaves((args, kwargs), is_leaf=none), tree_leaves((irargs, irkwargs), is_leaf=none)
        made: dict[int, tuple[IRTensor | None, Any]] = {}  # storage of a cast input -> (its IR tensor, dtype)

        def down(x, t):
            if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
                    or x.dtype == cast:
                return x
            k = (t.name, str(cast)) if isinstance(t, IRTensor) and t.kind == PARAM else None
            y = param_casts.get(k) if k else None
            if y is None:
                y = x.to(cast)
                if k:
                    param_casts[k] = y  # a parameter's cast is made once (the emitter caches it)
            made[_storage(y)] = (t, cast)
            return y
        if cast is not None:
            pairs = dict(zip(map(id, leaves), irleaves)) if len(leaves) == len(irleaves) else {}
            args, kwargs = tree_map(lambda x: down(x, pairs.get(id(x))), (args, kwargs))
        found: list[torch.Tensor] = []

        def pack(t):
            found.append(t)
            return t
        op = ops.get(name)
        calls = [lambda: node.target(*args, **kwargs)]
        if op is not None and op.known:  # the kernel the program calls (a vocabulary-parallel loss saves its own)
            calls.insert(0, lambda: _kernel(op, fakes, lambda x, t: down(x, t) if cast is not None else x))
        res = None
        for fn in calls:
            found.clear()
            with torch.set_grad_enabled(grad), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), inside:
                try:
                    res = fn()
                    break
                except Exception:  # noqa: BLE001 (no fake kernel: the next, or the op saves nothing seen)
                    res = None
        if res is None:
            return None
        outs = list(res) if isinstance(res, (list, tuple)) else [res]
        for x, t in zip(outs, ts):
            bind(x, t)
        near = [t for t in list(ts) + [x for x in irleaves if isinstance(x, IRTensor)] if t is not None and t.name in fakes]

        def like(x: torch.Tensor) -> IRTensor | None:
            """The tensor of the op a tensor its kernel made is split as: one of its shape, else the largest."""
            same = next((t for t in near if tuple(fakes[t.name].shape) == tuple(x.shape)), None)
            return same or max(near, key=lambda t: fakes[t.name].numel(), default=None)
        saves, seen = [], set()
        for s in found:
            st = _storage(s)
            if st in seen:
                continue
            seen.add(st)
            if st in made:
                t, dt = made[st]
                saves.append(Saved(t, read=True, cast=dt))
            elif st in roots:
                saves.append(Saved(roots[st], read=roots[st] not in ts))
            else:
                saves.append(Saved(None, nbytes=_nbytes(s), like=like(s)))
        if saves:
            out[name] = saves
        return res

    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with fake:
            visit(ep.graph, {}, "", True)
    finally:
        quiet.setLevel(level)
    return out, alias, sizes


def _kernel(op, fakes: dict, cast):
    """Call ``op``'s registered kernel on fake values as the generated program calls it, on one shard
    (:meth:`nnscaler.codegen.emit.Emitter._op`: annotated inputs, opaque ones resolved, the spec's
    keywords; a partition-aware kernel gets a context with nothing split)."""
    from ..ops.spec import resolve
    from ..runtime.partitioned import ShardContext
    spec, sizes = op.spec, dict(op.bound.sizes)
    args = []
    for i, x in enumerate(op.inputs[:len(spec.anno.inputs)]):
        if spec.anno.inputs[i].opaque:
            args.append(resolve(spec.args[i], sizes) if i in spec.args else x)
        else:
            args.append(cast(fakes[x.name], x) if isinstance(x, IRTensor) else x)
    kw = resolve(dict(spec.kwargs), sizes)
    if spec.local is not None:
        return spec.local(ShardContext(sizes), *args, **kw)
    return spec.fn(*args, **kw)


def saved_bytes(graph: IRGraph, plan, recompute: str = "none", modules=None, detail: dict | None = None) -> int:
    """Bytes one rank of ``plan`` (None: one device) keeps for backward at the end of its forward (module docstring):
    every storage saved outside a recomputed region once, at the layout it is saved in, plus each
    region's inputs; parameters left out (counted as parameters), their ``bf16-mixed`` casts in.
    ``detail``: filled with each storage's key and bytes."""
    from ..codegen.emit import stored_layouts
    from ..codegen.recompute import regions
    per_op, alias, sizes = saved_per_op(graph)
    mesh = plan.mesh_shape if plan is not None else ()
    lay = {id(op): op.layout(plan.partition(op)) if op.known and plan is not None else None for op in graph.ops}
    home = dict(stored_layouts(graph, plan)) if plan is not None else {}  # where each tensor lives as made
    for op in graph.ops:
        lo = lay[id(op)]
        for i, t in enumerate(op.outputs):
            if t is not None and lo is not None and i < len(lo.outputs) and lo.outputs[i] is not None:
                home[t] = lo.outputs[i]
        for i, x in enumerate(op.inputs):
            if isinstance(x, IRTensor) and x not in home and lo is not None and i < len(lo.inputs) and lo.inputs[i]:
                home[x] = lo.inputs[i]

    def at(t: IRTensor, layout) -> int:
        whole = nbytes(t)
        return (local_nbytes(t, layout, mesh) if layout is not None else whole) * sizes.get(t.name, whole) // max(1, whole)

    def read_of(op, t: IRTensor):
        """``(x, layout)``: the input of ``op`` that is ``t``, or else a view of it (``t`` its alias
        root: the logits a loss reads through a reshape), and the layout ``op`` reads it at."""
        lo = lay[id(op)]
        i = next((i for i, x in enumerate(op.inputs) if x is t), None)
        if i is None:
            i = next((i for i, x in enumerate(op.inputs) if isinstance(x, IRTensor) and alias.get(x.name) is t), None)
        if lo is None or i is None or i >= len(lo.inputs):
            return t, None
        return op.inputs[i], lo.inputs[i]

    def read_layout(op, t: IRTensor):
        x, want = read_of(op, t)
        return want if x is t else None

    found = regions([(op, k, k + 1) for k, op in enumerate(graph.ops)], recompute, modules)
    region_of = {k: r for r, (_, a, b) in enumerate(found) for k in range(a, b)}
    kept: dict[tuple, int] = {}
    for k, op in enumerate(graph.ops):
        if k in region_of:
            continue
        for s in per_op.get(op.name, ()):
            t = s.tensor
            if t is None:
                like = s.like
                frac = 1.0
                if like is not None:  # made from ``like`` as this operator reads it (a vocabulary-split piece)
                    x, want = read_of(op, like)
                    frac = at(x, want or home.get(x)) / max(1, nbytes(x))
                kept[("made", op.name, len(kept))] = int(s.nbytes * frac)
            elif s.cast is not None:
                b = at(t, read_layout(op, t) or home.get(t)) * s.cast.itemsize // t.dtype.itemsize
                kept[("cast", t.name if t.kind == PARAM else op.name, t.name)] = b
            elif t.kind != PARAM:
                x, want = read_of(op, t)  # x: t, or the view of it this operator reads
                have = home.get(x)
                if want is None or have is None or want == have:
                    kept[("storage", t.name)] = at(t, home.get(t))
                else:  # re-laid for this consumer: a storage of its own
                    kept[("laid", t.name, str(want))] = at(x, want)
    for _, a, b in found:  # a region keeps its inputs (torch.utils.checkpoint's arguments)
        inside = {id(t) for op in graph.ops[a:b] for t in op.outputs if t is not None}
        for op in graph.ops[a:b]:
            for t in op.tensor_inputs():
                if id(t) in inside or t.kind == PARAM:
                    continue
                r = alias.get(t.name, t)
                if r.kind != PARAM:
                    kept[("storage", r.name)] = at(r, home.get(r))
    if detail is not None:
        detail.update(kept)
    return sum(kept.values())


def saved_by_op(graph: IRGraph) -> tuple[dict[str, list[tuple[IRTensor, str, int, int]]], int]:
    """The saved storages of :func:`saved_bytes` with no recompute, each given to one operator so a
    planner can price it per partition (``nnscaler.policies.autodist_program``): ``{op name: [(tensor,
    "out" | "in", its index there, bytes whole)]}`` (the storage scales as ``tensor`` is laid out at that
    output or input of that operator), and the bytes of those owned by no operator (graph inputs).
    A tensor re-laid for a consumer is not counted (it depends on two operators' partitions)."""
    per_op, _, sizes = saved_per_op(graph)
    out: dict[str, list] = {}
    loose, seen = 0, set()
    for op in graph.ops:
        for s in per_op.get(op.name, ()):
            t = s.tensor
            if t is None:
                t, key, whole = s.like, ("made", op.name, len(seen)), s.nbytes
                if t is None:
                    loose += whole
                    continue
            elif s.cast is not None:
                key, whole = ("cast", t.name if t.kind == PARAM else op.name), nbytes(t) * s.cast.itemsize // t.dtype.itemsize
            elif t.kind == PARAM:
                continue
            else:
                key, whole = ("storage", t.name), sizes.get(t.name, nbytes(t))
            if key in seen:
                continue
            seen.add(key)
            owner = t.producer if key[0] == "storage" else op
            if owner is None:
                loose += whole
                continue
            if t in owner.outputs:
                out.setdefault(owner.name, []).append((t, "out", owner.outputs.index(t), whole))
            else:
                i = next((i for i, x in enumerate(owner.inputs) if x is t), None)
                if i is None:
                    loose += whole
                else:
                    out.setdefault(owner.name, []).append((t, "in", i, whole))
    return out, loose
