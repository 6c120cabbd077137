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
