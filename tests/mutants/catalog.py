"""The mutants: name -> a function that monkeypatches one small bug into the compiler or runtime.
Each is applied on import of a shim ``--module`` file (see ``run.py``), in the parent and in every rank,
before anything is compiled. Each is meant to change results on some built-in model and plan; one
that survives the full ``verify all`` is either a blind spot of the harness or a path no built-in
model reaches (say so in the runner's report)."""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

MUTANTS: dict[str, Callable[[], None]] = {}


def mutant(fn: Callable[[], None]) -> Callable[[], None]:
    MUTANTS[fn.__name__] = fn
    return fn


def apply(name: str) -> None:
    """Apply mutant ``name`` (a KeyError names the known ones)."""
    if name not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}")
    MUTANTS[name]()


def patch(owner, attr: str, value) -> None:
    """``setattr(owner, attr, value)``, refusing an attribute ``owner`` lacks: a mutant whose target
    was renamed fails to apply (the run is broken) instead of patching nothing and surviving."""
    if not hasattr(owner, attr):
        raise AttributeError(f"mutant target {getattr(owner, '__name__', owner)}.{attr} does not exist")
    setattr(owner, attr, value)


# -- differentiable collectives ----------------------------------------------------------------------
def _C():
    from nnscaler.runtime import collectives as C
    return C


@mutant
def all_reduce_missing():
    patch(_C(), "all_reduce", lambda x, group: x)


@mutant
def all_reduce_averages():
    C = _C()
    orig = C._sum
    patch(C, "_sum", lambda x, group: orig(x, group) / C._size(group))


@mutant
def all_gather_reversed_chunks():
    C = _C()

    def gather(x, dim, group, blocks=1):
        parts = [torch.empty_like(x) for _ in range(C._size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return C.join_blocks(parts[::-1], dim, blocks)
    patch(C, "_gather", gather)


@mutant
def split_off_by_one_chunk():
    C = _C()

    orig = C._chunk

    def chunk(x, dim, group, blocks=1):
        if blocks > 1:
            return orig(x, dim, group, blocks)
        n = C._size(group)
        return x.chunk(n, dim=dim)[(C._rank(group) + 1) % n].contiguous()
    patch(C, "_chunk", chunk)


@mutant
def split_backward_scaled():
    C = _C()
    patch(C._Split, "backward", staticmethod(
        lambda ctx, g: (C._gather(g, ctx.dim, ctx.group, ctx.blocks) * C._size(ctx.group), None, None, None)))


@mutant
def all_gather_backward_sums():
    C = _C()
    patch(C._AllGather, "backward", staticmethod(
        lambda ctx, g: (C._chunk(C._sum(g, ctx.group), ctx.dim, ctx.group, ctx.blocks), None, None, None)))


@mutant
def all_reduce_backward_sums():
    """The all-reduce's backward sums the (already whole) gradient over the group again."""
    C = _C()

    def forward(ctx, x, group):
        ctx.group = group  # the real forward keeps no group: its backward needs none
        return C._sum(x, group)
    patch(C._AllReduce, "forward", staticmethod(forward))
    patch(C._AllReduce, "backward", staticmethod(lambda ctx, g: (C._sum(g, ctx.group), None)))


@mutant
def grad_all_reduce_backward_missing():
    patch(_C()._GradAllReduce, "backward", staticmethod(lambda ctx, g: (g, None)))


@mutant
def grad_all_reduce_backward_averages():
    C = _C()
    patch(C._GradAllReduce, "backward", staticmethod(lambda ctx, g: (C._sum(g, ctx.group) / C._size(ctx.group), None)))


@mutant
def to_partial_on_every_rank():
    patch(_C()._ToPartial, "forward", staticmethod(lambda ctx, x, group: x.clone()))


@mutant
def reduce_scatter_skips_the_sum():
    C = _C()
    def forward(ctx, x, dim, group, blocks):
        ctx.dim, ctx.group, ctx.blocks = dim, group, blocks
        return C._chunk(x, dim, group, blocks)
    patch(C._ReduceScatter, "forward", staticmethod(forward))


@mutant
def all_to_all_backward_wrong_dims():
    C = _C()

    def backward(ctx, g):
        gather_dim, split_dim = ctx.dims
        return C._chunk(C._gather(g, gather_dim, ctx.group), split_dim, ctx.group), None, None, None
    patch(C._AllToAll, "backward", staticmethod(backward))


@mutant
def collectives_on_the_world_group():
    C = _C()
    for name in ("all_reduce", "grad_all_reduce", "to_partial"):
        orig = getattr(C, name)
        patch(C, name, lambda x, group, _o=orig: _o(x, None if group is None else dist.group.WORLD))


@mutant
def all_gather_on_one_rank_only():
    C = _C()
    orig = C.all_gather
    patch(C, "all_gather", lambda x, dim, group, blocks=1: x.repeat_interleave(C._size(group), dim)
          if group is not None and C._rank(group) == 0 and x.is_floating_point() else orig(x, dim, group, blocks))


# -- gradient sync -----------------------------------------------------------------------------------
def _GS():
    from nnscaler.runtime import grad_sync
    return grad_sync


@mutant
def grad_sync_missing():
    patch(_GS().GradSync, "attach", lambda self: None)


@mutant
def grad_sync_averages():
    GS = _GS().GradSync
    launch = GS._launch

    def mean(self, b):
        launch(self, b)
        b.handle.wait()
        b.flat /= dist.get_world_size(b.group)
    patch(GS, "_launch", mean)


@mutant
def grad_sync_offset_not_reset():
    GS = _GS().GradSync

    def finish(self):
        for b in self.buckets:
            if b.handle is None:
                self._launch(b)
        offset = 0
        for b in self.buckets:
            b.handle.wait()
            for p in b.params:
                n = p.numel()
                piece = b.flat[offset % max(b.flat.numel(), 1):][:n]
                if piece.numel() < n:
                    piece = torch.cat([piece, b.flat[: n - piece.numel()]])
                p.grad = piece.view_as(p).clone()
                offset += n
            b.flat, b.handle = None, None
        self._queued = False
    patch(GS, "_finish", finish)


@mutant
def grad_sync_on_the_world_group():
    GS = _GS().GradSync
    launch = GS._launch

    def on_world(self, b):
        group, b.group = b.group, None  # None: the default group, every rank
        try:
            launch(self, b)
        finally:
            b.group = group
    patch(GS, "_launch", on_world)


class _NotIssued:
    """The handle of a collective that was never issued."""

    def wait(self):
        return True


@mutant
def grad_sync_first_bucket_only():
    GS = _GS().GradSync
    launch = GS._launch

    def first_only(self, b):
        if b is self.buckets[0]:
            return launch(self, b)
        real = dist.all_reduce
        dist.all_reduce = lambda *args, **kwargs: _NotIssued()  # the other buckets keep this rank's own grads
        try:
            launch(self, b)
        finally:
            dist.all_reduce = real
    patch(GS, "_launch", first_only)


@mutant
def grad_sync_bucket_keeps_stale_params():
    GS = _GS().GradSync
    launch = GS._launch

    def lose_last(self, b):
        b.params[-1].grad = torch.zeros_like(b.params[-1])  # the bucket's last gradient is lost
        launch(self, b)
    patch(GS, "_launch", lose_last)


# -- the compiled module: shards, merges, loads ------------------------------------------------------
def _M():
    from nnscaler.runtime import module
    return module


@mutant
def shard_offset_reversed():
    from nnscaler.codegen import emit

    def slices(shape, layout, mesh_shape, rank):  # each axis's coordinate counted from the other end
        c = emit.coords(rank, mesh_shape)
        return emit.piece(shape, layout, mesh_shape, tuple(m - 1 - i for m, i in zip(mesh_shape, c)))
    patch(emit, "shard_slices", slices)


@mutant
def checkpoint_merge_reversed():
    M = _M()

    def whole(self, name, x):
        layout = self._program.STATE[name][1]
        for axis in reversed(range(len(layout))):
            q = M._parse_layout(layout)[axis]
            group = self._mesh.groups[axis]
            if q is not None and group is not None:
                parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, x.contiguous(), group=group)
                x = M.join_blocks(parts[::-1], q.dim, q.blocks)
        return x
    patch(M.ParallelModule, "_whole", whole)


@mutant
def checkpoint_drops_a_parameter():
    M = _M()
    orig = M.ParallelModule.state_dict

    def state_dict(self, *a, **k):
        out = orig(self, *a, **k)
        return {n: v for i, (n, v) in enumerate(out.items()) if i != 1}
    patch(M.ParallelModule, "state_dict", state_dict)


@mutant
def load_state_dict_ignored():
    patch(_M().ParallelModule, "load_state_dict", lambda self, state_dict, strict=True, assign=False: None)


@mutant
def load_state_dict_first_shard_everywhere():
    M = _M()
    orig = M.take
    patch(M, "take", lambda full, slices: orig(full, tuple((0, s[1] - s[0], *s[2:]) for s in slices)))


@mutant
def grad_all_reduce_forward_sums():
    C = _C()

    def forward(ctx, x, group):
        ctx.group = group
        return C._sum(x, group)
    patch(C._GradAllReduce, "forward", staticmethod(forward))


# -- plans, meshes, annotations, kernels ------------------------------------------------------------
@mutant
def mesh_axis_groups_swapped():
    from nnscaler.runtime import mesh
    build = mesh.RankMesh.build.__func__

    def swapped(cls, shape, rank, cache, offset=0):
        m = build(cls, shape, rank, cache, offset)
        return cls(m.shape, m.rank, tuple(reversed(m.groups)), m.offset) if len(m.groups) > 1 else m
    patch(mesh.RankMesh, "build", classmethod(swapped))


@mutant
def synced_over_the_wrong_axis():
    from nnscaler.codegen import emit
    orig = emit.synced_params

    def wrong(graph, plan):
        n = len(plan.mesh_shape)
        return {t: (a + 1) % n for t, a in orig(graph, plan).items()}
    patch(emit, "synced_params", wrong)


@mutant
def value_split_treated_as_spatial():
    from nnscaler.dimops import partition
    patch(partition, "VALUE", "+~")  # outputs lacking a '+' dimension are no longer partial sums


@mutant
def loss_mean_over_local_count():
    import opzoo._parallel_kernels as K
    C = _C()

    def reduce_rows(shard, loss, valid, reduction, row):
        if reduction == "none":
            return loss
        if reduction == "sum":
            return loss.sum()
        return loss.sum() / (valid.sum() * C._size(shard.group(row)))
    patch(K, "_reduce_rows", reduce_rows)


@mutant
def vocab_parallel_lookup_off_by_one():
    import opzoo._parallel_kernels as K
    orig = K.lookup

    def lookup(shard, cls, target, n):
        li, inside = orig(shard, cls, target, n)
        return li, inside if shard.group(cls) is None else (inside & (li != n - 1))
    patch(K, "lookup", lookup)


@mutant
def sum_reduction_forgets_partial():
    from nnscaler.runtime import collectives as C
    orig = C.all_reduce

    def maybe(x, group):  # a scalar partial value is left unsummed
        return x if x.dim() == 0 else orig(x, group)
    patch(C, "all_reduce", maybe)


# -- layout conversions (nnscaler/comm) and annotations ----------------------------------------------
def _conv():
    from nnscaler.comm import conversion
    return conversion


@mutant
def conversion_ignores_nesting():
    """Any axis may split or gather a dim another axis splits too (the per-axis bug of issue 13)."""
    patch(_conv(), "_outermost_free", lambda layout, axis, dim: True)
    _conv().layout_steps.cache_clear()


@mutant
def conversion_drops_the_partial_gradient_sum():
    """An ``R*`` consumer's partial gradient is never summed (no ``grad_all_reduce`` appended)."""
    conv = _conv()
    orig = conv.conversion
    patch(conv, "conversion", lambda src, dst, ids, mesh_shape, shape, grad:
          orig(src, dst, [None] * len(ids), mesh_shape, shape, grad))
    from nnscaler.codegen import emit
    if hasattr(emit, "conversion"):
        patch(emit, "conversion", conv.conversion)


@mutant
def all_to_all_reversed_chunks():
    C = _C()

    def forward(ctx, x, gather_dim, split_dim, group):
        ctx.dims, ctx.group = (gather_dim, split_dim), group
        parts = [torch.empty_like(x) for _ in range(C._size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return C._chunk(torch.cat(parts[::-1], dim=gather_dim), split_dim, group)
    patch(C._AllToAll, "forward", staticmethod(forward))


@mutant
def all_gather_sum_grad_backward_unsummed():
    C = _C()
    patch(C._AllGatherSumGrad, "backward", staticmethod(
        lambda ctx, g: (C._chunk(g, ctx.dim, ctx.group, ctx.blocks), None, None, None)))


@mutant
def split_ignores_blocks():
    """A split of one factor of a fused dim (``D1/3``) takes a contiguous chunk instead."""
    C = _C()
    orig = C._chunk
    patch(C, "_chunk", lambda x, dim, group, blocks=1: orig(x, dim, group, 1))


@mutant
def rules_lose_frozen_dims():
    """Wrong annotations: the layer rules (layer_norm, rms_norm, attention) leave the dims they must
    keep whole (``h^``, the key length, the head dim) splittable."""
    import opzoo.rules.nn as nn
    mark = nn.mark
    patch(nn, "mark", lambda dim, marker: dim if marker == "^" else mark(dim, marker))


# -- gradient accumulation (micro-batches, ParallelModule.train_step) --------------------------------
def _MB():
    from nnscaler.runtime import microbatch
    return microbatch


@mutant
def grad_sync_before_the_last_micro_batch():
    """``no_sync`` does nothing, and a gradient already holding its group's sum is not divided back
    before the next backward: every micro-batch's backward syncs, and the next sums synced gradients
    again (the reducer launched before the last micro-batch counts the earlier ones once per rank)."""
    @contextmanager
    def paused(self):
        yield
    patch(_GS().GradSync, "paused", paused)
    patch(_GS().GradSync, "_unsum", lambda self, p, b: None)


@mutant
def loss_scaled_per_micro_batch():
    """Each micro-batch's loss is its own mean and the batch's the mean of those: right only when every
    micro-batch averages as many elements (not with unevenly padded targets)."""
    MB = _MB()
    terms = MB.loss_terms

    def per_micro_batch(loss, rows):
        total, count = terms(loss, rows)
        return total / count.to(total.dtype), torch.ones((), dtype=torch.float64)
    patch(MB, "loss_terms", per_micro_batch)


# -- applying a mutant for one case only (tests on a shared rank gang) --------------------------------

@mutant
def pipeline_checkpoint_saves_blocked_pieces_as_shards():
    """A pipeline's checkpoint writes a piece split in blocks (a fused qkv's rows: this rank's chunk of
    q, of k and of v) as if it were a contiguous shard, without making it whole on its axis first."""
    from nnscaler.pipeline import checkpoint as PC
    patch(PC, "gather_blocks", lambda module, items: [t for _, t in items])

PATCHED_MODULES = ("nnscaler.runtime.collectives", "nnscaler.runtime.grad_sync", "nnscaler.runtime.microbatch",
                   "nnscaler.runtime.module", "nnscaler.runtime.mesh", "nnscaler.codegen.emit",
                   "nnscaler.dimops.partition", "opzoo._parallel_kernels", "nnscaler.pipeline.checkpoint")


@contextmanager
def applied(name: str) -> Iterator[None]:
    """Mutant ``name`` applied inside the block only: every attribute of :data:`PATCHED_MODULES` and of
    the classes they define is put back afterwards, so a rank gang shared with other tests stays clean."""
    targets = []
    for module in map(importlib.import_module, PATCHED_MODULES):
        targets += [module, *(v for v in vars(module).values()
                              if isinstance(v, type) and v.__module__ == module.__name__)]
    saved = [(t, dict(vars(t))) for t in targets]
    apply(name)
    try:
        yield
    finally:
        for t, before in saved:
            now = vars(t)
            for k in [k for k in now if k not in before]:
                delattr(t, k)
            for k, v in before.items():
                if now.get(k) is not v:
                    setattr(t, k, v)
