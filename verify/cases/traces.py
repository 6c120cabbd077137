"""A rank's trace cache: a whole-model case compiles its model three or four times (the plan under
test, the checkpoint reloaded under another plan, the resumed run under plan B), and ``verify all``
compiles each model under every policy; each compile would export the same model again, the largest
part of a compile. The graph depends only on the model's structure, the values a trace bakes in
(:func:`_baked`) and the traced arguments' shapes, not on the weights, so the cache traces once per
(model, structure, baked values, argument shapes) and hands every compile a copy: the cases of one
model under several seeds (the random plans' seeds) share one trace.

``torch.export`` has no cache of its own (each call re-traces), hence this one."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Mapping, Sequence

import hashlib

import torch

from nnscaler.ir.graph import IRGraph
from nnscaler.ops.registry import DEFAULT_REGISTRY
from nnscaler.trace.build import Tracer, trace

KEEP = 8  # graphs kept (least recently used goes first): a model's policies run one after another


def _signature(value: Any) -> Any:
    """What of an argument a trace depends on: a tensor's shape, dtype and device; plain values as they are."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    if isinstance(value, Mapping):
        return ("map", tuple(sorted((k, _signature(v)) for k, v in value.items())))
    return ("value", repr(value))


def _structure(model: torch.nn.Module) -> tuple:
    """The model's class and every parameter's and buffer's name, shape and dtype: a builder that
    made another model under the same name misses the cache instead of reusing a wrong graph."""
    return (type(model).__qualname__,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()))


_MODULE_OWN = frozenset(vars(torch.nn.Module()))  # nn.Module's own bookkeeping (_parameters, hooks, training)


def _digest(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest() if data.numel() else ""


def _baked(model: torch.nn.Module) -> tuple:
    """What a trace bakes into the program besides the structure: each module's tensor attributes
    that are neither parameters nor buffers (lifted as constants) and its plain scalar attributes,
    by value. Parameters and buffers are the program's inputs, so their values (the seed's draw) are
    not in it; a builder that draws a constant or a scale from its seed misses the cache."""
    out = []
    for name, module in model.named_modules():
        for k, v in vars(module).items():
            if k in _MODULE_OWN:
                continue
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                out.append((name, k, tuple(v.shape), v.dtype, _digest(v) if v.device.type != "meta" else ""))
            elif isinstance(v, (bool, int, float, str)) or v is None:
                out.append((name, k, v))
    return tuple(out)


class TraceCache:
    """Graphs traced on this rank, by the caller's key (the model's name), the model's structure and
    baked values (:func:`_baked`) and the traced arguments; :meth:`tracer` is what
    ``parallelize(tracer=...)`` takes."""

    def __init__(self, keep: int = KEEP):
        self.keep, self.graphs, self.hits, self.misses = keep, OrderedDict(), 0, 0

    def tracer(self, key: Hashable) -> Tracer:
        """A tracer for the model ``key`` names: a copy of the graph traced before on the same
        arguments, or a new trace (kept)."""
        def traced(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *,
                   registry=None, strict: bool = False) -> IRGraph:
            known = (DEFAULT_REGISTRY if registry is None else registry).fingerprint()
            full = (key, _structure(model), _baked(model), _signature(tuple(args)), _signature(dict(kwargs or {})),
                    known, strict)
            if full in self.graphs:
                self.hits += 1
                self.graphs.move_to_end(full)
            else:
                self.misses += 1
                self.graphs[full] = trace(model, args, kwargs, registry=registry, strict=strict)
                while len(self.graphs) > self.keep:
                    self.graphs.popitem(last=False)
            return self.graphs[full].copy()
        return traced


def graph_ops(traces: "TraceCache | None", key: Hashable) -> dict | None:
    """What the verdict cache keys a model case on (:mod:`verify.sweep.cache`): the aten operators of the
    graphs ``traces`` holds for ``key`` (``ops``), and those of them no rule annotated (``fixed``: a
    catalogue entry matched, or nothing did); None when it holds no graph for ``key``."""
    graphs = [g for full, g in (traces.graphs.items() if traces is not None else ()) if full[0] == key]
    if not graphs:
        return None
    ops = [op for g in graphs for op in g.ops]
    return {"ops": sorted({op.overload for op in ops}),
            "fixed": sorted({op.overload for op in ops if op.spec is None or not op.spec.name.startswith("rule.")})}


def tracer_of(traces: TraceCache | None, key: Hashable) -> Tracer | None:
    """``traces.tracer(key)``, or None (``parallelize`` traces afresh) without a cache."""
    return None if traces is None else traces.tracer(key)
