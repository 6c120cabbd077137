"""Mutants of plans, meshes, annotations and parallel kernels."""
from __future__ import annotations

from ._base import _C, mutant, patch


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
    import opzoo.kernels as K
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
    import opzoo.kernels as K
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


@mutant
def rules_lose_frozen_dims():
    """Wrong annotations: the layer rules (layer_norm, rms_norm, attention) leave the dims they must
    keep whole (``h^``, the key length, the head dim) splittable."""
    import opzoo.nn.rules as nn
    mark = nn.mark
    patch(nn, "mark", lambda dim, marker: dim if marker == "^" else mark(dim, marker))


@mutant
def draw_per_shard():
    """Random draws shaped like their input (``rand_like``, ``uniform``, ``exponential``) draw only the
    shard's numbers: each rank's jitter differs from one device's."""
    import torch
    import opzoo.kernels as K
    patch(K, "draw", lambda shard, x, *args, fn, dims, **kwargs: fn(torch.empty_like(x), *args, **kwargs))


@mutant
def strided_slice_read_as_blocks():
    """A strided whole-dim slice (``x[..., 1::2]``) annotated phase-major, ``(step m) -> m``: each rank's
    step through its own block is read as if the phases lay in blocks."""
    import opzoo.slicing.rules as R
    orig = R._strided

    def blocked(call, n, start, end, step, names):
        got = orig(call, n, start, end, step, names)
        return got and (f"({step} {got[1]})", got[1])
    patch(R, "_strided", blocked)


@mutant
def whole_extreme_per_shard():
    """A whole ``max()``/``min()``/``any()``/``all()`` of an integer or boolean tensor split by its rule
    keeps each rank's shard result (no all-reduce): XLM's ``lengths.max()`` guard reads one rank's rows."""
    import opzoo.kernels as K
    patch(K, "_max_over", lambda v, groups: v)
