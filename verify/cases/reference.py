"""The single-device side of a whole-model case, computed once per case: on the case's first rank,
which hands every other rank of the case the very same tensors over the case's process group.

Each rank still judges its own parallel tensors (loss, gradients, parameters after its step, state
dicts, reloads) against what it receives, so a wrong program that shows on one rank only is caught on
that rank; only the reference moves. The other ranks never build or run the reference models (the
recipe's dtype and float64): on W ranks of one machine that work ran W times over, and under
``torchrun`` (``verify.cluster``) the model need fit the first rank's device alone.

What travels is tensors, numbers and names (``torch.distributed.broadcast_object_list``), never a
model object; with it the state of the case's :class:`~verify.judge.compare.Float64Fallback` (the
operators it fell back on or promoted, the record of single-device spreads of bf16 recipes, the
random draws it could not draw as the run did), which the bounds and verdicts of the checks read."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from nnscaler.runtime.mesh import GroupCache

from verify.judge.compare import Float64Fallback

T = TypeVar("T")


class ReferenceFailed(RuntimeError):
    """The reference raised on the rank that computes it (the other ranks raise this, naming its error)."""


class SharedReference:
    """Where a case's reference runs (:attr:`computes`) and how its results reach the case's other
    ranks (:meth:`share`). Every rank of the case calls :meth:`share` at the same points, in the same order."""

    def __init__(self, group=None):
        self.group = group  # None: one rank (or no process group): computed here, nothing sent
        self.src = dist.get_process_group_ranks(group)[0] if group is not None else None

    @classmethod
    def of(cls, groups: GroupCache, world_size: int) -> "SharedReference":
        """The reference of a case on ranks ``0 .. world_size - 1`` (the group the gang made for them);
        where the gang holds no such group, each rank computes it itself (the old way: slower, as right)."""
        if world_size <= 1 or not dist.is_initialized():
            return cls()
        try:
            return cls(groups.get(list(range(world_size))))
        except KeyError:
            return cls()

    @property
    def computes(self) -> bool:
        """Whether this rank computes the reference (the others receive it)."""
        return self.group is None or dist.get_rank() == self.src

    def share(self, compute: Callable[[], T], fallback: Float64Fallback | None = None) -> T:
        """``compute()`` on the computing rank; every rank returns its result (the others an exact copy),
        and ``fallback`` on every rank takes the computing rank's state after it. An error of ``compute``
        is raised on every rank (:class:`ReferenceFailed` on the others), so no rank waits for a result."""
        if self.group is None:
            return compute()
        box: list = [None]
        if self.computes:
            try:
                out = compute()
            except Exception as exc:
                box[0] = ("error", f"{type(exc).__name__}: {exc}".splitlines()[0], None)
                dist.broadcast_object_list(box, src=self.src, group=self.group)
                raise
            box[0] = ("ok", out, _state(fallback))
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            return out
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        status, out, state = box[0]
        if status == "error":
            raise ReferenceFailed(f"the single-device reference failed on rank {self.src}: {out}")
        _adopt(fallback, state)
        return out


def _state(fallback: Float64Fallback | None):
    if fallback is None:
        return None
    return sorted(fallback.used), sorted(fallback.promoted), fallback.spreads.rel, \
        list(fallback.draws.problems), sorted(fallback.draws.redrawn), fallback.kinks_followed


def _adopt(fallback: Float64Fallback | None, state) -> None:
    """``fallback`` takes the computing rank's state (its spread record in place: a resumed phase shares it)."""
    if fallback is None or state is None:
        return
    used, promoted, rel, problems, redrawn, fallback.kinks_followed = state
    fallback.used, fallback.promoted = set(used), set(promoted)
    fallback.draws.problems[:], fallback.draws.redrawn = list(problems), set(redrawn)
    fallback.spreads.rel.clear()
    fallback.spreads.rel.update(rel)


def reference_models(name: str, seed: int, like: torch.nn.Module, dt: torch.dtype, precision, lr: float):
    """The computing rank's single-device models of a case: the recipe's (in ``dt``), float64, its
    parameters by name and its AdamW."""
    from verify.cases.fresh import built_like
    ref = precision.reference(built_like(name, seed, like, dt))
    return ref, built_like(name, seed, ref, torch.float64), dict(ref.named_parameters()), \
        torch.optim.AdamW(ref.parameters(), lr=lr)


def reference_grads(params: dict, ref64: torch.nn.Module) -> tuple[dict, dict]:
    """The gradients of the single-device ``params`` (by name) and of the float64 ``ref64`` by the same
    names (``None`` where one has none), copied; ``ref64``'s are then cleared (its next step starts
    from zero)."""
    rp64 = dict(ref64.named_parameters())
    copy = lambda g: None if g is None else g.clone()  # noqa: E731
    out = {n: copy(p.grad) for n, p in params.items()}, {n: copy(rp64[n].grad) for n in params}
    ref64.zero_grad()
    return out
