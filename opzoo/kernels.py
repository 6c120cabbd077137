"""Partition-aware kernels shared by opzoo entries whose split is not "the plain op on the shard".

Every kernel is called as ``kernel(shard, *local_inputs, **kwargs)`` (see
:class:`nnscaler.runtime.partitioned.ShardContext`) and must also work unsplit (group ``None``,
offset 0, factor 1). Identifier names are bound with ``functools.partial(kernel, ident=...)``.

Autograd conventions (see :mod:`nnscaler.runtime.collectives`):

* :func:`allsum` — a sum every rank then uses identically (its cotangent is replicated): the
  backward is the identity;
* :func:`allsum_shared` — a sum each rank then combines with its own shard: the backward sums the
  cotangents over the group;
* a value computed whole on every rank is returned as a partial value with ``C.to_partial``, whose
  backward hands the (replicated) cotangent to every rank.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nnscaler.runtime import collectives as C


def allsum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group``; backward identity (the result is used the same way on every rank)."""
    return C.all_reduce(x, group)


def allsum_shared(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group``; backward sums the cotangents (each rank uses it with its own shard)."""
    return C.grad_all_reduce(C.all_reduce(x, group), group)


def allmax(x: torch.Tensor, group) -> torch.Tensor:
    """Element-wise maximum over ``group`` of a detached tensor (no gradient)."""
    x = x.detach()
    if group is None:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def whole_extreme(shard, x: torch.Tensor, *, op: str, idents: tuple[str, ...]) -> torch.Tensor:
    """``max()``/``min()``/``any()``/``all()`` of the whole integer or boolean tensor whose shard is
    ``x`` (``op``: ``"max"`` for max and any, ``"min"`` for min and all): the shard's, then the
    maximum (of the negation, for ``"min"``) over the group of each split identifier of ``idents``."""
    fn = {(torch.bool, "max"): torch.any, (torch.bool, "min"): torch.all}.get((x.dtype, op),
                                                                             torch.max if op == "max" else torch.min)
    out = fn(x)
    groups = [g for g in (shard.group(i) for i in idents) if g is not None]
    if not groups:
        return out
    v = out.to(torch.int64)  # (gloo reduces no bool)
    return (_max_over(v, groups) if op == "max" else -_max_over(-v, groups)).to(out.dtype)


def _max_over(v: torch.Tensor, groups: list) -> torch.Tensor:
    """The element-wise maximum of ``v`` over every group of ``groups`` in turn (one all-reduce each)."""
    for g in groups:
        v = allmax(v, g)
    return v


def shift(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The max over ``dim`` across ``group`` (keepdim, detached), 0 where it is not finite: the
    usual shift before ``exp`` that keeps all ``-inf`` rows at ``-inf`` instead of NaN."""
    m = allmax(x.detach().amax(dim, keepdim=True), group)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def lookup(shard, ident: str, index: torch.Tensor, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global indices along ``ident`` -> (local indices, with 0 where outside; mask of those inside)."""
    off = shard.offset(ident)
    inside = (index >= off) & (index < off + n_local)
    return torch.where(inside, index - off, torch.zeros_like(index)), inside


def _bcast(mask: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    """A 1-d mask along ``dim`` shaped to broadcast against an ``ndim``-d tensor."""
    shape = [1] * ndim
    shape[dim % ndim] = -1
    return mask.view(shape)


# --- value-split lookups (vocabulary parallel) --------------------------------------------------

def embedding(shard, weight, index, *, ident="v"):
    """Vocabulary-parallel ``torch.embedding(weight, index)`` (aten's order): rows outside this rank's
    range come out zero (a partial value)."""
    li, inside = lookup(shard, ident, index, weight.shape[0])
    return torch.embedding(weight, li).masked_fill(~inside.unsqueeze(-1), 0)


def index_select(shard, x, dim, index, *, ident="v"):
    """``index_select`` with the indexed dim split by value (1-d index)."""
    li, inside = lookup(shard, ident, index, x.shape[dim])
    return torch.index_select(x, dim, li).masked_fill(~_bcast(inside, dim, x.dim()), 0)


def gather(shard, x, dim, index, *, ident="n"):
    """``gather`` with the gathered dim split by value."""
    li, inside = lookup(shard, ident, index, x.shape[dim])
    return torch.gather(x, dim, li).masked_fill(~inside, 0)


# --- reductions over a dim split by value --------------------------------------------------------

def mean(shard, x, *args, idents=("n",), **kwargs):
    """Local sum divided by the FULL count: the partial sums add up to the mean."""
    return torch.sum(x, *args, **kwargs) / math.prod(shard.full(i) for i in idents)


def amax(shard, x, dim=-1, keepdim=False, *, ident="n", smallest=False):
    """Exact amax/amin over a split dim; the gradient is shared evenly between ties, as torch does."""
    g = shard.group(ident)
    if smallest:
        m = -allmax(-x.detach().amin(dim, keepdim=True), g)
    else:
        m = allmax(x.detach().amax(dim, keepdim=True), g)
    hits = (x.detach() == m) & torch.isfinite(m)
    count = C.all_reduce(hits.sum(dim, keepdim=True), g).clamp(min=1)
    # zero in value, gradient 1/count on every tie; the first rank adds the maximum itself
    part = torch.where(hits, x - m, torch.zeros_like(x)).sum(dim, keepdim=True) / count
    out = part + (m if shard.index(ident) == 0 else torch.zeros_like(m))
    return out if keepdim else out.squeeze(dim)


def amin(shard, x, dim=-1, keepdim=False, *, ident="n"):
    return amax(shard, x, dim, keepdim, ident=ident, smallest=True)


def logsumexp(shard, x, dim=-1, keepdim=False, *, ident="n"):
    g = shard.group(ident)
    m = shift(x, dim, g)
    out = allsum((x - m).exp().sum(dim, keepdim=True), g).log() + m
    return C.to_partial(out if keepdim else out.squeeze(dim), g)


def vector_norm(shard, x, ord=2, dim=None, keepdim=False, *, ident="n"):
    if ord != 2:
        raise NotImplementedError(f"vector_norm over a split dim supports ord=2 only, not {ord}")
    g = shard.group(ident)
    return C.to_partial(allsum((x * x).sum(dim, keepdim=keepdim), g).sqrt(), g)


def var(shard, x, dim=-1, *, correction=1, keepdim=False, ident="n"):
    """Two-pass variance; each rank's share of the squared deviations is a partial value."""
    g, n = shard.group(ident), shard.full(ident)
    mu = allsum_shared(x.sum(dim, keepdim=True), g) / n
    return ((x - mu) ** 2).sum(dim, keepdim=keepdim) / (n - correction)


def std(shard, x, dim=-1, *, correction=1, keepdim=False, ident="n"):
    g = shard.group(ident)
    v = allsum(var(shard, x, dim, correction=correction, keepdim=keepdim, ident=ident), g)
    return C.to_partial(v.sqrt(), g)


# --- losses --------------------------------------------------------------------------------------

def _reduce_rows(shard, loss, valid, reduction, row):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    count = C.all_reduce(valid.sum(), shard.group(row))
    return loss.sum() / count


def cross_entropy(shard, logits, target, reduction="mean", ignore_index=-100, *, row="n", cls="v"):
    """Megatron's vocabulary-parallel cross entropy, rows optionally split by value too."""
    g = shard.group(cls)
    m = shift(logits, -1, g)
    sumexp = allsum((logits - m).exp().sum(-1), g)
    m = m.squeeze(-1)
    li, inside = lookup(shard, cls, target, logits.shape[-1])
    picked = logits.gather(-1, li.unsqueeze(-1)).squeeze(-1)
    tgt = allsum(torch.where(inside, picked, torch.zeros_like(picked)), g)
    valid = target != ignore_index
    loss = torch.where(valid, sumexp.log() + m - tgt, torch.zeros_like(tgt))
    return _reduce_rows(shard, C.to_partial(loss, g), valid, reduction, row)


def nll_loss(shard, logp, target, reduction="mean", ignore_index=-100, *, row="n", cls="v"):
    """``nll_loss`` with classes split by value: a masked local pick is already a partial value."""
    li, inside = lookup(shard, cls, target, logp.shape[-1])
    picked = -logp.gather(-1, li.unsqueeze(-1)).squeeze(-1)
    valid = target != ignore_index
    loss = torch.where(inside & valid, picked, torch.zeros_like(picked))
    return _reduce_rows(shard, loss, valid, reduction, row)


def pointwise_loss_mean(shard, x, y, *, fn, idents=("a", "b"), **kwargs):
    """A mean-reduced pointwise loss over a tensor split by value: local sum / full count."""
    return fn(x, y, reduction="sum", **kwargs) / math.prod(shard.full(i) for i in idents)


# --- random draws -----------------------------------------------------------------------------

def dropout(shard, x: torch.Tensor, p: float = 0.5, train: bool = True, *, dims: tuple[str, ...]) -> torch.Tensor:
    """``aten.dropout`` on a shard, drawing the mask one device draws: every rank draws the whole
    tensor's mask (``dims`` are the identifiers of ``x``'s dims, ``"1"`` for a length-1 dim) from the
    same generator state, as CPU ``aten.dropout`` does (``bernoulli_(1 - p)`` on a tensor of the
    input's shape, divided by ``1 - p``), and keeps its slice. Drawing only the shard's numbers would
    give each rank another mask than one device's. Costs the whole mask's draw on every rank, no
    communication."""
    if not train or p == 0:
        return x.clone()
    full = [shard.full(d) if d in shard.sizes else int(d) for d in dims]
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    noise = torch.empty(full, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    return x * noise[_own(shard, dims)]


def _own(shard, dims: tuple[str, ...]) -> tuple:
    """The index of this rank's slice of a whole tensor whose dims are ``dims``."""
    return tuple(slice(shard.offset(d), shard.offset(d) + shard.local(d)) if d in shard.sizes else slice(None)
                 for d in dims)


def draw(shard, x: torch.Tensor, *args, fn, dims: tuple[str, ...], **kwargs) -> torch.Tensor:
    """A random tensor shaped like ``x`` (``fn``: ``aten.rand_like``, ``aten.uniform``, ...) on a shard,
    as :func:`dropout` draws its mask: the whole tensor drawn on every rank from the same generator
    state, this rank's slice kept (no communication)."""
    full = [shard.full(d) if d in shard.sizes else int(d) for d in dims]
    return fn(torch.empty(full, dtype=x.dtype, device=x.device), *args, **kwargs)[_own(shard, dims)]
