"""Mutants of the compiled module and its checkpoints: shards, merges, loads (``nnscaler/runtime/module.py``,
``nnscaler/codegen/emit.py``, ``nnscaler/checkpoint/pipeline.py``)."""
from __future__ import annotations

from ._base import mutant, patch


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
    """Merges (``state_dict``, a checkpoint's blocked pieces) join the ranks' pieces in reverse order."""
    from nnscaler.runtime import merge
    orig = merge.join_blocks
    patch(merge, "join_blocks", lambda parts, dim, blocks: orig(parts[::-1], dim, blocks))


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
def pipeline_checkpoint_saves_blocked_pieces_as_shards():
    """A pipeline's checkpoint writes a piece split in blocks (a fused qkv's rows: this rank's chunk of
    q, of k and of v) as if it were a contiguous shard, without making it whole on its axis first."""
    from nnscaler.checkpoint import pipeline as PC
    patch(PC, "gather_blocks", lambda module, items: [t for _, t in items])


@mutant
def blocked_load_other_axis():
    import types

    from nnscaler.checkpoint import format as F, layout as L, pipeline as P, sharded as S
    real = L.load_buffer

    def load_buffer(module, name, like):  # a piece split in blocks is cut by the other mesh axis's coordinate
        m = module.mesh
        mesh = types.SimpleNamespace(shape=m.shape, groups=m.groups, coords=tuple(reversed(m.coords)))
        return real(types.SimpleNamespace(_program=module._program, mesh=mesh), name, like)
    for owner in (L, F, P, S):  # each took the name at import
        patch(owner, "load_buffer", load_buffer)


@mutant
def recipe_steps_skipped():
    """``train_step`` (and a loop's ``after_backward``) does none of the recipe's steps on the gradients:
    ``clip_grad_norm`` set, nothing is clipped (``nnscaler/runtime/grad_steps.py``)."""
    from nnscaler.runtime import grad_steps
    patch(grad_steps, "GRAD_STEPS", {})
