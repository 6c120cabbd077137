"""The compile step of a precision recipe: mark the operators whose inputs ``bf16-mixed`` casts (see
:mod:`nnscaler.runtime.precision`)."""
from __future__ import annotations

import torch

from ..config import PlanError
from ..runtime.precision import tensors_device_type
from ..trace.amp import asserted_dtype, autocast_casts


def prepare_model(model: torch.nn.Module, args, kwargs, precision: str):
    """``bf16-true``: the model converted to bf16 in place (as Lightning's ``bf16-true`` converts it), its
    floating sample arguments cast, so the trace, the stages' metadata and the state are bf16 alike.
    Returns the sample ``(args, kwargs)``."""
    if precision != "bf16-true":
        return args, kwargs
    model.to(torch.bfloat16)
    down = lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    return tuple(down(a) for a in args), None if kwargs is None else {k: down(v) for k, v in kwargs.items()}


ATEN = ("aten.", "prims.", "_operator.", "operator.")  # operators autocast handles itself (or plain Python)


def _dtype_assert(op) -> bool:
    return asserted_dtype(op.overload, op.inputs, op.kwargs) is not None


def apply_precision(graph, precision: str) -> None:
    """Set ``op.cast`` on every operator of ``graph``: for ``bf16-mixed``, the dtype autocast casts its
    floating inputs to on this device type (``"drop"`` for an assert of the fp32 trace's dtype);
    None otherwise. ``op.literals``: the constants of the fp32 trace it computes with in bf16 instead
    (:mod:`nnscaler.trace.amp`)."""
    for op in graph.ops:
        op.cast = "drop" if precision != "32-true" and _dtype_assert(op) else None
        op.literals = None
    if precision != "bf16-mixed":
        return
    if graph.exported is None:
        raise PlanError("precision='bf16-mixed' needs the torch.export program the graph was traced from "
                        "(the tracer returned a graph without it)")
    found = getattr(graph.exported, "_nnscaler_casts", None)
    if found is None:
        kind = tensors_device_type(n.meta.get("val") for n in graph.exported.graph.nodes if n.op == "placeholder")
        try:
            found = autocast_casts(graph.exported, kind, torch.bfloat16)
        except Exception as exc:  # an operator without a bf16 kernel (or meta kernel) on this device
            raise PlanError(f"precision='bf16-mixed': the model cannot run under torch.autocast({kind!r}, "
                            f"bfloat16): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
                            f"use precision='32-true'") from None
        graph.exported._nnscaler_casts = found  # one fake run per trace, shared by its copies
    casts, literals = found
    for op in graph.ops:
        op.cast = casts.get(op.name, op.cast)
        if op.cast is None and not op.overload.startswith(ATEN):  # its body computes under autocast
            op.cast = "autocast"  # (nnscaler.runtime.precision.autocast_run)
        op.literals = literals.get(op.name)
