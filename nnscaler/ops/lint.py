"""Static annotation lint: mistakes visible in an annotation alone, warned at ``register_op``.

An identifier of the inputs that no output holds and that carries neither ``+`` nor ``^`` is consumed
by the operator (a sum, a mean, a norm); a spatial split of it leaves each rank with a different
result and nothing to combine them, unless the spec names it ``coupled`` (its kernel combines the
ranks' results itself: a whole ``max()`` all-reduced). ``verify.lint`` adds the checks that run the function.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..dimops.grammar import SPATIAL, OpAnno
from .spec import OpSpec


class AnnotationWarning(UserWarning):
    """A registered annotation that is probably wrong (the message says how to fix it)."""


@dataclass(frozen=True)
class Finding:
    """One lint finding: the operator, the identifier, what is wrong and how to fix it."""

    op: str
    ident: str
    kind: str  # "consumed" | "mixes" | "not-additive" | "backward" | "failed"
    message: str

    def __str__(self) -> str:
        return f"{self.op}: {self.message}"


def _named(anno: OpAnno, tensors) -> set[str]:
    return {i.name for t in tensors for d in t.dims for i in d.idents if not (i.is_number or i.is_star)}


def lint_static(spec: OpSpec) -> list[Finding]:
    """Findings from the annotation alone (cheap: run on every ``register_op``)."""
    anno = spec.anno
    outs = _named(anno, anno.outputs)
    markers = anno.markers()
    hidden = {i.name for t in anno.inputs + anno.outputs for d in t.dims for i in d.idents[1:]}  # never split
    found = []
    ones = {k for k, v in spec.sizes.items() if v == 1}  # a length fixed at 1 is never split
    for t in anno.inputs:  # an identifier twice in one tensor (``l l``: a diagonal) is never split
        names = [i.name for d in t.dims for i in d.idents if not (i.is_number or i.is_star)]
        ones |= {n for n in names if names.count(n) > 1}
    for ident in sorted(_named(anno, anno.inputs) - outs - hidden - ones - set(spec.coupled)):
        if markers.get(ident) == SPATIAL:
            found.append(Finding(spec.name, ident, "consumed", (
                f"identifier {ident!r} is in the inputs of {spec.annotation!r} but in no output, and it is marked "
                f"spatial: the op consumes that dim, so a split gives each rank a different result. Write "
                f"'{ident}+' if the op adds over it (results become partial sums), or '{ident}^' if it must never "
                f"be split (a dim of length 1 may stay as it is)")))
    return found


