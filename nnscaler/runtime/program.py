"""Helpers generated programs import."""
from __future__ import annotations

from contextvars import ContextVar

import torch
import torch.distributed as dist

from ..ops.registry import DEFAULT_REGISTRY
from ..ops.spec import OpSpec


def registered(name: str) -> OpSpec:
    """A registered operator whose function has no importable name (a lambda, say)."""
    return DEFAULT_REGISTRY.get(name)


def write_buffer(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into this rank's piece of a buffer, in place and outside autograd: what the
    model's forward wrote into it (``self.ema.mul_(0.5).add_(...)``), carried out by the program."""
    with torch.no_grad():
        buffer.copy_(value)


class GuardFailed(RuntimeError):
    """A guard of the program (a data-dependent branch or size the trace fixed) does not hold: ``name``
    the guard's operator (``guard_3``), ``where`` the model's line, ``text`` the condition traced,
    ``on_state`` whether it reads the model's state alone (parameters, buffers), not its input."""

    def __init__(self, message: str, name: str, where: str, text: str, on_state: bool):
        super().__init__(message)
        self.name, self.where, self.text, self.on_state = name, where, text, on_state


# the data-parallel replicas' group while a module with replicas runs its program (else None): data guards are
# agreed over it, and operators mixing the rows of a batch a buffer is written from run over it (.replica_rows)
REPLICAS: ContextVar = ContextVar("nnscaler_replicas", default=None)


def guard(held, name: str, where: str, text: str, message: str, on_state: bool) -> None:
    """Check a guard of the program; raise :class:`GuardFailed` with ``message`` when it fails.

    The plan's ranks compute it alike (from whole tensors). Data-parallel replicas read different
    data: a guard on data is agreed over their group (:data:`REPLICAS`, set by the module while it runs),
    so that every rank raises, one line naming the model's line, where some replica's data breaks it
    (no rank goes on into a collective the others never reach). A guard on the state alone holds alike
    on every replica (parameters are kept equal; a buffer written from the batch is written from every
    replica's rows, :mod:`nnscaler.compile.writes`), so it costs no collective."""
    ok = bool(held)
    group = REPLICAS.get()
    if group is not None and not on_state:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if ok and not int(flag.item()):
            path, _, code = where.partition(": ")
            raise GuardFailed(f"data-dependent branch or size at {path}" + (f" ({code})" if code else "")
                              + f": another data-parallel replica's input breaks {text}, which this rank's holds "
                              f"(replicas must take the same branch; every replica raises)", name, where, text, on_state)
    if not ok:
        raise GuardFailed(message, name, where, text, on_state)
