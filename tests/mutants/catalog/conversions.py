"""Mutants of the layout conversions (``nnscaler/comm``)."""
from __future__ import annotations

from ._base import mutant, patch


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


class _LongerFirst(dict):
    """The emitter's chains taken so far, answering a chain's prefix with the longest chain it begins."""

    def _longest(self, key):
        return max((k for k in self if k[0] is key[0] and k[1][:len(key[1])] == key[1]), key=lambda k: len(k[1]),
                   default=None)

    def __contains__(self, key):
        return self._longest(key) is not None

    def __getitem__(self, key):
        return dict.__getitem__(self, self._longest(key))


@mutant
def conversion_chain_taken_from_a_longer_one():
    """A reader whose chain of layout steps begins an earlier reader's longer chain takes that whole
    chain (Megatron's f included): a residual add reading the embedding whole after a column-parallel
    projection read it gets its gradient summed over ranks too (the right rule: go on from a prefix)."""
    from nnscaler.codegen import emit
    orig = emit.Emitter.__init__

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.taken = _LongerFirst()
    patch(emit.Emitter, "__init__", init)
