"""Coalescing: independent all-reduces on one mesh axis that are ready at the same point of forward
issued as one collective (flattened, concatenated, summed, cut back: ``C.all_reduce_coalesced``).

OLMo-2's q_norm and k_norm (RMSNorm over the column-split q and k) each all-reduce their statistics;
the k statistics need only k's projection, which reads nothing another rank sends, so the program
computes k's statistics before q's are summed and sums both in one call, as an expert writes it.

:func:`schedule` reads one emission of the program (the conversion steps, the operator each feeds,
and which operators read a tensor through a forward collective) and returns the operator order and
the groups to emit together. A later all-reduce joins an earlier one's group when everything its
tensor still needs (the operators from the earlier reader on that it is computed from) can move
before the earlier reader: none of them reads through a forward collective (so no other collective
moves and none depends on the earlier sum), draws random numbers or is a data-dependent guard, and
its tensor has the earlier one's dtype. Backward of an all-reduce is the identity: nothing is
coalesced there.
"""
from __future__ import annotations

from typing import NamedTuple

from ..comm.conversion import Step
from ..ir.graph import GUARD, IROp, IRTensor

FORWARD_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_sum_grad"})
WINDOW = 8  # later all-reduces looked at for each group (the statistics of one layer's norms)


class Candidate(NamedTuple):
    """An all-reduce starting a conversion chain: of ``tensor`` by ``step``, for operator ``reader``."""

    tensor: IRTensor
    step: Step
    reader: IROp


def _needs(t: IRTensor, at: int, pos: dict[IROp, int]) -> set[IROp]:
    """The operators at position ``at`` or later that ``t`` is computed from (its producer included)."""
    out: set[IROp] = set()
    todo = [t.producer] if t.producer is not None else []
    while todo:
        op = todo.pop()
        if op in out or op not in pos or pos[op] < at:
            continue
        out.add(op)
        todo.extend(x.producer for x in op.tensor_inputs() if x.producer is not None)
    return out


def schedule(ops: list[IROp], candidates: list[Candidate], through: dict[IROp, list[IROp]]
             ) -> tuple[list[IROp], list[tuple]]:
    """(operator order, groups): each group ``((tensor, step), ...)`` (two or more all-reduces on one
    axis) is summed in one collective right before its first reader, the operators the later tensors
    need moved before it. ``candidates``: the all-reduces of one emission in ``ops``' order;
    ``through``: per operator reading a tensor through a forward collective, the operators at which
    those were issued (it may move before the group's first reader only if all were issued before)."""
    order = list(ops)
    groups: list[tuple] = []
    used: set[int] = set()
    for i, (t1, s1, r1) in enumerate(candidates):
        if i in used:
            continue
        pos = {op: k for k, op in enumerate(order)}
        at = pos[r1]
        group, moved = [(t1, s1)], set()
        for j in range(i + 1, min(len(candidates), i + 1 + WINDOW)):
            t2, s2, _ = candidates[j]
            if j in used or s2.axis != s1.axis or t2.dtype != t1.dtype or t2 is t1:
                continue
            need = _needs(t2, at, pos) - moved
            if any(op.draws_random or op.overload == GUARD or any(pos[o] >= at for o in through.get(op, ()))
                   for op in need):
                continue
            group.append((t2, s2))
            moved |= need
            used.add(j)
        if len(group) > 1:
            groups.append(tuple(group))
            order = order[:at] + sorted(moved, key=pos.get) + [op for op in order[at:] if op not in moved]
    return order, groups
