"""ZeRO over the data-parallel ranks of a plan (``ComputeConfig(zero=1|2)``).

The *zero group* of a rank is every rank holding the same pieces of every parameter: the ranks along
the plan's data-parallel mesh axis (the ``dp`` policy's axis, ``hybrid``'s ``dp`` axis) times the
data-parallel replicas (``runtime_ngpus > plan_ngpus``). After backward their gradients are equal, so
each rank may update only its share and the updated pieces be gathered back.

Layout (the Megatron-LM distributed optimizer / DeepSpeed one): the trainable parameters of a rank
are packed, in buckets, into flat buffers of which the parameters become views; each bucket is padded
to a multiple of the zero group's size ``n`` and its rank ``k`` owns elements ``[k c, (k+1) c)``.
The inner optimizer (``torch.optim.AdamW``, ...) runs on those owned slices only, so its state is
``1/n`` of plain data parallelism's; after its step one all-gather per bucket rebuilds the parameters.

- zero 1: gradients are synced as without ZeRO (all-reduce, :mod:`.grad_sync`); each rank reads its
  slice of them.
- zero 2: the gradients that need no sum outside the zero group (a data-parallel plan's, a replica's)
  are reduce-scattered during backward, bucket by bucket as they become ready, into this rank's
  gradient shard; the full ``.grad`` is then freed, and the packed bucket once its reduce-scatter is
  done (one in flight at a time, :data:`IN_FLIGHT`: the next launch waits for it). A parameter also summed over another axis (a
  norm's weight under ``tp`` with replicas) keeps its all-reduce and is sliced, as under zero 1.
- zero 3: also the parameters: each rank keeps only its slice of every bucket (``shard``, what the
  optimizer steps); the whole bucket is all-gathered when the program first reads one of its
  parameters and freed once nothing holds it, then gathered again in backward for the tensors autograd
  saved (:mod:`.zero3`). Buckets follow the model's blocks (``h.0``, ``layers.3``), so one block's
  parameters are whole at a time. Every gradient is reduce-scattered, a gradient also summed over
  another mesh axis after that sum.

Why not torch's own pieces: ``ZeroRedundancyOptimizer`` assigns whole parameters to ranks (one large
embedding holds more than ``1/n`` of the state), consolidates its state on one rank to checkpoint it,
and has no gradient reduce-scatter; FSDP2's ``fully_shard`` replaces the parameters by ``DTensor``s
and drives its own gradient reduction, which conflicts with the generated program's in-plan sums
(:mod:`.grad_sync`) over other mesh axes. The slices here are exact for optimizers that update each
element from that element's gradient and state alone (:data:`ELEMENTWISE`); others are refused.
A parameter with no gradient in a step is updated with a zero gradient (as DeepSpeed and Megatron do).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from .buckets import ReadyBuckets
from .shard_grad import ShardGrad, real

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adadelta", "ASGD")


IN_FLIGHT = 1  # reduce-scatters under way at once: launching another waits for the oldest and frees its bucket


class ZeroError(ValueError):
    """An optimizer that sharding over the zero group would make wrong."""


@dataclass
class ZeroBucket:
    params: list[torch.nn.Parameter]
    scales: list[float]  # zero 2: each gradient is multiplied by this before the reduce-scatter
    scatter: bool  # zero 2 and every gradient here needs no sum outside the zero group (zero 3: always)
    sum_group: object = None  # zero 3: the in-plan group its gradients are summed over first (None: none)
    group: object = None  # the ranks holding the same pieces of these parameters (the zero group, or a smaller one)
    n: int = 1  # how many: the bucket is cut into n slices
    index: int = 0  # which slice is this rank's
    offsets: list[int] = field(default_factory=list)
    flat: torch.Tensor | None = None  # the parameters' storage, padded to n * chunk
    chunk: int = 0
    shard: torch.nn.Parameter | None = None  # this rank's slice of ``flat`` (what the inner optimizer steps)


class ZeroShards:
    """The flat buffers and this rank's slices of one :class:`~nnscaler.runtime.module.ParallelModule`'s
    trainable parameters over the zero ``group`` (``ranks``: its global ranks, in order)."""

    def __init__(self, params: list[torch.nn.Parameter], stage: int, group, ranks: list[int],
                 sums_outside: dict[int, object], scales: dict[int, float], bucket_bytes: int,
                 block_of: dict[int, str] | None = None, dp_axis: int | None = None,
                 unscattered: frozenset[int] = frozenset(), own_groups: dict[int, tuple] | None = None):
        """``sums_outside``: id of a parameter whose gradient is also summed over another mesh axis ->
        that axis's group; ``block_of`` (zero 3): id -> the model block it belongs to (one bucket per
        block, at most ``bucket_bytes`` each); ``unscattered``: ids of parameters whose gradients are
        summed after backward elsewhere (tied across pipeline stages): synced whole and sliced, as
        under zero 1, and under zero 3 kept whole; ``own_groups``: id -> ``(group, ranks)`` for a
        parameter fewer ranks hold the same piece of (one split along the data-parallel axis, an
        expert's, is the same on the replicas only)."""
        self.stage, self.group, self.ranks = stage, group, list(ranks)
        self.dp_axis = dp_axis  # the plan's data-parallel mesh axis (part of the zero group), or None
        self.buckets: list[ZeroBucket] = []
        self.schedule = ReadyBuckets(lambda b: self._launch(b), lambda: self._complete())  # zero 2: scattered when complete
        self._materialized = False
        self._pending: list[tuple] = []  # (bucket, work, out, packed gradients) of the reduce-scatters under way
        self.most_pending = 0  # the most reduce-scatters (packed gradient buckets) alive at once so far
        self.regathered: dict[int, torch.Tensor] = {}  # zero 3: buckets gathered again in backward, by id
        open_: dict[tuple, ZeroBucket] = {}
        block_of, own_groups = block_of or {}, own_groups or {}
        for p in reversed(params):  # roughly the order backward produces gradients
            scatter = id(p) not in unscattered and (stage >= 3 or (stage == 2 and id(p) not in sums_outside))
            outside = sums_outside.get(id(p)) if stage >= 3 else None
            group, members = own_groups.get(id(p), (self.group, self.ranks))
            key = (p.dtype, p.device, scatter, block_of.get(id(p)), id(outside), tuple(members))
            b = open_.get(key)
            if b is None or sum(q.numel() * q.element_size() for q in b.params) >= bucket_bytes:
                n = len(members)
                b = open_[key] = ZeroBucket([], [], scatter, outside, group, n,
                                            list(members).index(dist.get_rank()) if n > 1 else 0)
                self.buckets.append(b)
            b.params.append(p)
            b.scales.append(scales.get(id(p), 1.0))
        for b in self.buckets:
            self._pack(b)
        self._where = {id(p): (b, off) for b in self.buckets for p, off in zip(b.params, b.offsets)}

    def _pack(self, b: ZeroBucket) -> None:
        """Move the bucket's parameters into one flat buffer (they become views of it)."""
        total = sum(p.numel() for p in b.params)
        b.chunk = -(-total // b.n)
        b.flat = torch.zeros(b.chunk * b.n, dtype=b.params[0].dtype, device=b.params[0].device)
        off = 0
        with torch.no_grad():
            for p in b.params:
                b.offsets.append(off)
                b.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = b.flat[off:off + p.numel()].view_as(p)
                off += p.numel()
        mine = b.flat[b.index * b.chunk:(b.index + 1) * b.chunk]
        if self.stage < 3 or not b.scatter:
            b.shard = torch.nn.Parameter(mine)
        else:  # zero 3: the slice is all this rank keeps; the bucket's storage is freed (the parameters keep
            b.shard = torch.nn.Parameter(mine.clone())  # their shapes, as views of it, for `materialized`)
            b.flat.untyped_storage().resize_(0)

    # -- zero 2: gradients reduce-scattered during backward --------------------------------------------
    def attach(self) -> None:
        scattered = [b for b in self.buckets if b.scatter]
        self.schedule.attach(scattered)
        for b in scattered:  # a backward accumulates into .grad: the placeholder goes first (.shard_grad)
            for p in b.params:
                p.register_hook(lambda g, p=p: _drop_placeholder(p))

    @property
    def paused(self) -> bool:
        """Zero 2: no reduce-scatter while set (gradients accumulate in ``.grad``; see ``no_sync``)."""
        return self.schedule.paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self.schedule.paused = value

    def finish(self) -> None:
        """Reduce-scatter now what the backward passes left (zero 2: every bucket none launched) and wait."""
        self.schedule.end()

    def scatter_grads(self, b: ZeroBucket, grads) -> None:
        """Zero 3: reduce-scatter ``grads`` (one per parameter of ``b``, ``None`` for none) into the
        shard's gradient (added at the end of backward)."""
        self.schedule.begin()
        self._launch(b, grads)

    def _launch(self, b: ZeroBucket, grads=None) -> None:
        """Pack the bucket's gradients (``grads``, or the parameters' ``.grad``, then freed), scaled, and
        start their reduce-scatter; a zero 3 bucket whose gradients are also summed over another mesh
        axis is all-reduced there first."""
        grad_flat = torch.zeros(b.chunk * b.n, dtype=b.flat.dtype, device=b.flat.device)
        for i, (p, off, scale) in enumerate(zip(b.params, b.offsets, b.scales)):
            g = real(p.grad) if grads is None else grads[i]
            if g is not None:
                view = grad_flat[off:off + p.numel()]
                view.copy_(g.reshape(-1))
                if scale != 1.0:
                    view.mul_(scale)
                if grads is None:
                    p.grad = None  # freed: this rank keeps its shard only
        if b.sum_group is not None:
            dist.all_reduce(grad_flat, group=b.sum_group)
        out = torch.empty(b.chunk, dtype=b.flat.dtype, device=b.flat.device)
        work = None
        if b.n > 1:
            work = dist.reduce_scatter_tensor(out, grad_flat, group=b.group, async_op=True)
        else:
            out.copy_(grad_flat)
        self._pending.append((b, work, out, grad_flat))  # the packed gradients live until the scatter is done
        while len(self._pending) > IN_FLIGHT:  # the older ones are waited for: their packed gradients freed now,
            self._settle(*self._pending.pop(0))  # not at the end of backward (which held the stage's gradients whole)
        self.most_pending = max(self.most_pending, len(self._pending))

    def _settle(self, b: ZeroBucket, work, out: torch.Tensor, grad_flat: torch.Tensor) -> None:
        """Wait for one bucket's reduce-scatter and add it into the shard's gradient (in launch order)."""
        if work is not None:
            work.wait()
        b.shard.grad = out if b.shard.grad is None else b.shard.grad.add_(out)

    def _complete(self) -> None:
        if self.stage == 2:  # every bucket is scattered once per backward, on every rank (zeros where none)
            for b in self.buckets:
                if b.scatter and id(b) not in self.schedule.launched:
                    self._launch(b)
        for entry in self._pending:
            self._settle(*entry)
        self._pending = []
        for b in self.buckets:  # .grad says where the gradient is (.shard_grad), rather than reading None
            if b.scatter:
                for p in b.params:
                    if p.grad is None:
                        p.grad = ShardGrad(p, lambda p=p: self.grad_pieces(p), self.stage)
        self.regathered.clear()

    # -- the optimizer's side ---------------------------------------------------------------------------
    def shard_grads(self) -> None:
        """Each slice's gradient: zero 2's reduce-scattered shard, or this rank's slice of the synced
        (all-reduced) ``.grad`` of its parameters."""
        for b in self.buckets:
            if b.scatter:
                if b.shard.grad is None:
                    b.shard.grad = torch.zeros_like(b.shard)
                continue
            if all(p.grad is None for p in b.params):
                b.shard.grad = None
                continue
            lo, hi = b.index * b.chunk, (b.index + 1) * b.chunk
            g = torch.zeros(b.chunk, dtype=b.flat.dtype, device=b.flat.device)
            for p, off in zip(b.params, b.offsets):
                a, z = max(lo, off), min(hi, off + p.numel())
                if a < z and p.grad is not None:
                    g[a - lo:z - lo].copy_(p.grad.reshape(-1)[a - off:z - off])
            b.shard.grad = g

    def gather_params(self) -> None:
        """Every rank's updated slice back into every rank's parameters (one all-gather per bucket);
        zero 3 gathers them when next used instead."""
        for b in self.buckets:
            if (self.stage >= 3 and b.scatter) or b.n == 1:
                continue
            dist.all_gather_single(b.flat, b.shard.detach().clone(), group=b.group)

    def gather(self, b: ZeroBucket, slice_: torch.Tensor) -> torch.Tensor:
        """The whole bucket-shaped tensor from every rank's ``slice_`` of it."""
        if b.n == 1:
            return slice_.clone()
        out = torch.empty(b.chunk * b.n, dtype=slice_.dtype, device=slice_.device)
        dist.all_gather_single(out, slice_.contiguous(), group=b.group)
        return out

    # -- zero 3: whole buckets on demand --------------------------------------------------------------------
    def gathered(self, b: ZeroBucket) -> torch.Tensor:
        """A new tensor holding bucket ``b`` whole (all-gathered from the group's shards)."""
        return self.gather(b, b.shard.detach())

    def regather(self, b: ZeroBucket) -> torch.Tensor:
        """Zero 3, in backward: bucket ``b`` whole, gathered once until :meth:`release` (or the end of
        backward) for every saved tensor that reads it."""
        flat = self.regathered.get(id(b))
        if flat is None:
            flat = self.regathered[id(b)] = self.gathered(b)
        return flat

    def release(self, b: ZeroBucket) -> None:
        self.regathered.pop(id(b), None)

    @contextmanager
    def materialized(self, writeback: bool = False) -> Iterator[None]:
        """Zero 3: inside, every parameter holds its whole local piece (the buckets' storage gathered);
        with ``writeback`` each rank's slice is then copied back into its shard (after a load). Nests;
        other stages: nothing to do."""
        if self.stage < 3 or self._materialized:
            yield
            return
        self._materialized = True
        sharded = [b for b in self.buckets if b.scatter]
        try:
            with torch.no_grad():
                for b in sharded:
                    b.flat.untyped_storage().resize_(b.flat.numel() * b.flat.element_size())
                    b.flat.copy_(self.gathered(b))
            yield
            if writeback:
                with torch.no_grad():
                    for b in sharded:
                        b.shard.copy_(b.flat[b.index * b.chunk:(b.index + 1) * b.chunk])
        finally:
            for b in sharded:
                b.flat.untyped_storage().resize_(0)
            self._materialized = False

    def grad_pieces(self, p: torch.nn.Parameter) -> list[torch.Tensor] | None:
        """Zero 2/3: the slices of ``p``'s reduce-scattered gradient this rank holds (``[]``: none);
        ``None`` where ``p``'s gradient is not reduce-scattered (it is in ``p.grad``)."""
        hit = self._where.get(id(p))
        if hit is None or not hit[0].scatter:
            return None
        b, off = hit
        if b.shard.grad is None:
            return []
        lo, hi = b.index * b.chunk, (b.index + 1) * b.chunk
        a, z = max(lo, off), min(hi, off + p.numel())
        return [b.shard.grad.detach()[a - lo:z - lo]] if a < z else []

    def full_grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """Zero 2: the synced gradient of ``p`` gathered from the shards (collective over the group)."""
        for b in self.buckets:
            for q, off in zip(b.params, b.offsets):
                if q is p:
                    if not b.scatter:
                        return p.grad
                    if b.shard.grad is None:
                        return None
                    return self.gather(b, b.shard.grad)[off:off + p.numel()].view_as(p)
        return p.grad

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.shard.grad = None
            for p in b.params:
                p.grad = None


def _drop_placeholder(p: torch.nn.Parameter) -> None:
    if isinstance(p.grad, ShardGrad):
        p.grad = None


class ZeroOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over this rank's slices of the parameters (see the module's docstring) of one
    :class:`ZeroShards` or several (a pipeline's stages on this rank).
    A ``torch.optim.Optimizer`` whose ``param_groups`` and ``state`` are the inner optimizer's (so a
    learning-rate scheduler drives it as any optimizer);
    :meth:`param_state` and :meth:`load_param_state` speak per-parameter state, as a plain optimizer
    over the module's parameters holds it (what checkpoints store)."""

    def __init__(self, shards: ZeroShards | list[ZeroShards], optimizer_class: type, **kwargs):
        parts = [shards] if isinstance(shards, ZeroShards) else list(shards)
        if optimizer_class.__name__ not in ELEMENTWISE:
            raise ZeroError(f"zero={parts[0].stage}: {optimizer_class.__name__} is not elementwise, so it cannot run "
                            f"on slices of the parameters; use one of {', '.join(ELEMENTWISE)}, or zero=0")
        self.parts = parts
        self._buckets = [(z, b) for z in parts for b in z.buckets]
        self.optim = optimizer_class([b.shard for _, b in self._buckets], **kwargs)
        self.kind = optimizer_class.__name__
        super().__init__([b.shard for _, b in self._buckets], self.optim.defaults)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state  # one copy: the inner one's

    def params(self) -> list[torch.nn.Parameter]:
        """The module's parameters this optimizer updates."""
        return [p for _, b in self._buckets for p in b.params]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ZeroError("ZeroOptimizer.step does not take a closure")
        for z in self.parts:
            z.shard_grads()
        self.optim.step()
        for z in self.parts:
            z.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for z in self.parts:
            z.zero_grad()

    def param_state(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's optimizer state as a plain optimizer over the module would hold it:
        elementwise tensors gathered from the group's slices (collective), scalars (``step``) as
        they are. Parameters of a bucket never stepped have none."""
        out: dict = {}
        for z, b in self._buckets:
            st = self.optim.state.get(b.shard, {})
            if not st:
                continue
            whole = {k: (z.gather(b, v) if isinstance(v, torch.Tensor) and v.dim() else v)
                     for k, v in sorted(st.items())}
            for p, off in zip(b.params, b.offsets):
                out[p] = {k: (v[off:off + p.numel()].view_as(p).clone() if isinstance(v, torch.Tensor) and v.dim()
                              else (v.clone() if isinstance(v, torch.Tensor) else v)) for k, v in whole.items()}
        return out

    def load_param_state(self, state: dict) -> None:
        """The inverse of :meth:`param_state`: each parameter's state (its whole local piece) cut to
        this rank's slices. A scalar is taken from the bucket's first parameter that has it."""
        for z, b in self._buckets:
            have = [p for p in b.params if state.get(p)]
            if not have:
                continue
            lo, hi = b.index * b.chunk, (b.index + 1) * b.chunk
            new: dict = {}
            for k, v in state[have[0]].items():
                if isinstance(v, torch.Tensor) and v.dim():
                    s = torch.zeros(b.chunk, dtype=v.dtype, device=b.shard.device)
                    for p, off in zip(b.params, b.offsets):
                        a, e = max(lo, off), min(hi, off + p.numel())
                        if a < e and k in state.get(p, {}):
                            s[a - lo:e - lo].copy_(state[p][k].reshape(-1)[a - off:e - off])
                    new[k] = s
                else:
                    new[k] = v.clone() if isinstance(v, torch.Tensor) else v
            self.optim.state[b.shard] = new

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optim.load_state_dict(state_dict)


# -- a torch sharded optimizer applied by hand ----------------------------------------------------------
_HOOKED = False


def guard_hand_zero() -> None:
    """Install (once) a global optimizer pre-step hook refusing a ``ZeroRedundancyOptimizer`` whose
    process group spans ranks holding different pieces of a parallelized module's parameters (it
    would broadcast one rank's tensor-parallel shard over another's: silently wrong), and any
    optimizer made by hand over the parameters of a module compiled with ``zero >= 2`` (it would find
    no gradients and silently step nothing)."""
    global _HOOKED
    if _HOOKED:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(_check_hand_zero)
    _HOOKED = True


def _check_hand_zero(optimizer, args, kwargs):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    stage = max((getattr(p, "_nnscaler_zero_stage", 0) for g in optimizer.param_groups for p in g["params"]),
                default=0)
    if stage >= 2:  # ZeroOptimizer steps its shards, never the module's parameters: this one is by hand
        raise ZeroError(f"{type(optimizer).__name__} over the parameters of a module compiled with zero={stage} would "
                        f"step nothing: their gradients live in this rank's shards; build it with "
                        f"module.build_optimizer({type(optimizer).__name__}, ...)")
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return
    ranks = set(dist.get_process_group_ranks(optimizer.process_group)) if optimizer.process_group is not None \
        else set(range(dist.get_world_size()))
    for p in getattr(optimizer, "_all_params", []):
        same = getattr(p, "_nnscaler_same_ranks", None)
        if same is not None and not ranks <= same:
            raise ZeroError("ZeroRedundancyOptimizer over a parallelized module's parameters: its process group spans "
                            "ranks holding different shards; use ComputeConfig(zero=1) and module.build_optimizer(...)")
