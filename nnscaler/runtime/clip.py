"""Gradient-norm clipping over the whole model, each piece of each gradient counted exactly once.

A rank holds pieces of parameters: split along some mesh axes (``D`` in the generated program's
``STATE`` layout), whole along the others (``R``: every rank of that axis holds the same gradient once
backward's sync has run), and every data-parallel replica holds the same pieces again. So each rank
counts the pieces that it alone is the first holder of: a parameter's piece counts on the rank at
coordinate 0 of every mesh axis that does not split it, on replica 0 only; one all-reduce of that sum
over every rank of the module gives the whole model's ``sum |g|^p``, which every rank then clips by (as
``torch.nn.utils.clip_grad_norm_`` does on one device). A pipeline adds its stages' sums (a parameter
tied across stages counts in its owner stage only).

``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)`` by hand would see this rank's shards only and
compute a local norm. torch offers no hook for it, so while a compiled module is alive (and only then:
:func:`register` routes, and the last module's collection restores torch's own function) torch's norm
of a list of gradients (``torch.nn.utils.clip_grad._get_total_norm``, which ``clip_grad_norm_`` and
``get_total_norm`` call, however they were imported) is, when the list is exactly the gradients of a
live compiled module, that module's whole-model norm; a list holding some of a module's gradients but
not all (one parameter group, say) warns that the norm is local; any other list goes to torch's own
function untouched. Importing nnscaler changes nothing in torch. Under zero 2/3 a parameter's ``.grad``
is a placeholder of its gradient's slices (:mod:`.shard_grad`), so the hand call counts and clips them
too. The built-in :meth:`ParallelModule.clip_grad_norm_` (or ``ComputeConfig(clip_grad_norm=...)``,
which ``train_step`` applies) is the direct way.
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as _torch_clip

from .shard_grad import real

_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # compiled modules (ParallelModule, PipelineModule) alive


class LocalNormWarning(UserWarning):
    """A gradient norm over part of a compiled module's local shards: not the whole model's norm."""


def register(module) -> None:
    """Let torch's own norm functions recognise ``module``'s gradients while it is alive (module
    docstring): the route is installed with the first live module and removed with the last."""
    _LIVE.add(module)
    routed = _torch_clip._get_total_norm
    if not getattr(routed, "_nnscaler", False):
        routed = _routed(routed)
        _torch_clip._get_total_norm = routed
    routed.users[0] += 1
    weakref.finalize(module, _release, routed)


def _release(routed) -> None:
    """One live module fewer: with none left, torch's own function is back (unless another hook has
    wrapped ours since: then ours stays, passing everything through)."""
    routed.users[0] -= 1
    if routed.users[0] == 0 and _torch_clip._get_total_norm is routed:
        _torch_clip._get_total_norm = routed.original


def _grad_ids(module) -> set[int]:
    return {id(p.grad) for p in module.parameters() if p.grad is not None}


def _routed(original):
    """``original`` (torch's ``_get_total_norm``) routing the gradient list of a live compiled module to
    its whole-model norm (module docstring)."""

    def _total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        ids = {id(t) for t in tensors}
        if ids and _LIVE:
            mods = sorted(_LIVE, key=lambda m: -len(list(m.parameters())))  # a pipeline before its stages
            for mod in mods:
                own = _grad_ids(mod)
                if ids == own:
                    total = mod.grad_norm(float(norm_type))
                    if error_if_nonfinite and not torch.isfinite(total):
                        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, "
                                           f"so it cannot be clipped")
                    return total
            if any(ids & _grad_ids(mod) for mod in mods):
                warnings.warn("a gradient norm over some of a compiled module's local shards is this rank's local "
                              "norm, not the whole model's: pass all of module.parameters(), or use "
                              "module.clip_grad_norm_(max_norm) / ComputeConfig(clip_grad_norm=...)",
                              LocalNormWarning, stacklevel=3)
        return original(tensors, norm_type, error_if_nonfinite, foreach)

    _total_norm._nnscaler = True
    _total_norm.original = original
    _total_norm.users = [0]  # live modules registered through it
    return _total_norm


def counted_grads(module, skip: Iterable[str] = (), first_replica: bool = True) -> list[torch.Tensor]:
    """The gradients of ``module`` (a :class:`~nnscaler.runtime.module.ParallelModule`) this rank
    counts in the whole model's norm: the pieces no rank before it on a mesh axis that replicates them
    holds too, on the first replica only (``first_replica``). Under ZeRO 2/3 a gradient is
    reduce-scattered over the zero group (the ``dp`` axis and the replicas), each rank holding a
    different slice: its slices count on every rank of that group, under the same rule for the other
    axes. ``skip``: model names left out (a tied parameter counted by another stage)."""
    coords = module.mesh.coords
    zero = getattr(module, "_zero", None)
    skip = set(skip)
    out = []
    for key, name in module._names.items():
        p = getattr(module, key)
        if not isinstance(p, torch.nn.Parameter) or name in skip:
            continue
        layout = module._program.STATE[name][1]
        pieces = zero.grad_pieces(p) if zero is not None else None
        if pieces is not None:  # reduce-scattered: this rank's slices of it
            if all(c == 0 for a, (q, c) in enumerate(zip(layout, coords))
                   if not str(q).startswith("D") and a != zero.dp_axis):
                out += pieces
        elif first_replica and p.grad is not None and all(c == 0 for q, c in zip(layout, coords)
                                                           if not str(q).startswith("D")):
            out.append(p.grad.detach())
    return out


def holders(module) -> list[torch.Tensor]:
    """Every tensor whose ``.grad`` clipping scales: the parameters of ``module`` and of its compiled
    submodules, and their ZeRO shards (whose gradients zero 2/3 reduce-scatter)."""
    out = list(module.parameters())
    for m in module.modules():
        zero = getattr(m, "_zero", None)
        if zero is not None:
            out += [b.shard for b in zero.buckets if b.scatter]
    return out


def local_sum(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """``sum |g|^p`` over ``grads`` (``max |g|`` for ``p = inf``), in float64."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads])
    return norms.max() if math.isinf(norm_type) else (norms ** norm_type).sum()


def total_norm(counted: torch.Tensor, norm_type: float, group, dtype: torch.dtype) -> torch.Tensor:
    """The whole model's norm from every rank's ``counted`` sum (one all-reduce over ``group``)."""
    counted = counted.clone()
    if math.isinf(norm_type):
        dist.all_reduce(counted, op=dist.ReduceOp.MAX, group=group)
        return counted.to(dtype)
    dist.all_reduce(counted, group=group)
    return (counted ** (1.0 / norm_type)).to(dtype)


def clip_(params: Iterable[torch.nn.Parameter], max_norm: float, total: torch.Tensor,
          error_if_nonfinite: bool = False) -> None:
    """Scale every gradient by ``max_norm / (total + 1e-6)`` where that is below 1 (torch's rule)."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of the gradients is non-finite ({float(total)}), so it cannot be "
                           f"clipped; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if real(p.grad) is not None:  # a zero 2/3 placeholder's slices are the shard's, scaled with it
                p.grad.mul_(coef.to(p.grad.dtype))


def grad_dtype(params: Iterable[torch.nn.Parameter]) -> torch.dtype:
    return next((p.grad.dtype for p in params if p.grad is not None), torch.float32)


def is_first_replica(replica_group) -> bool:
    """Whether this rank is in replica 0 of the plan (the replica group lists ranks by replica), the only
    replica whose pieces count: the others hold the same averaged gradients."""
    return replica_group is None or dist.get_group_rank(replica_group, dist.get_rank()) == 0
