"""Mutants of the generated program's frees (``nnscaler/codegen/frees.py``)."""
from __future__ import annotations

from ._base import mutant, patch


def early(lines: list[str], free) -> list[str]:
    """``free(lines)`` with every ``del`` moved above the statement before it: each value freed one
    statement before its last use."""
    out = list(free(lines))
    for k in range(len(out)):
        if not out[k].lstrip().startswith("del "):
            continue
        j = k - 1
        while j >= 0 and out[j].lstrip().startswith(("#", "del ")):
            j -= 1
        indent = len(out[k]) - len(out[k].lstrip())
        if j >= 0 and len(out[j]) - len(out[j].lstrip()) == indent:
            out.insert(j, out.pop(k))
    return out


@mutant
def intermediate_freed_one_step_early():
    """The generated forward deletes each intermediate one statement before its last read."""
    from nnscaler.codegen import emit
    orig = emit.free_dead
    patch(emit, "free_dead", lambda lines: early(lines, orig))
