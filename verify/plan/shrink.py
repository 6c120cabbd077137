"""Verify a traced operator at reduced, annotation-equivalent lengths.

Whether a partition of an operator is right depends on the annotation's structure (which dims are
split, summed, replicated) and on divisibility, not on how long a dim is. So each (operator,
partition) pair of a plan is verified with every identifier shrunk to the smallest length that
keeps what the verdict can depend on:

* every length stays divisible by its split factor times its block count under the partition;
* lengths keep their order and their equalities (two identifiers of equal length stay equal, a
  longer one stays longer), so a function relating them sees the same relations;
* a length below 2 is kept (a broadcast dim stays a broadcast dim), fixed lengths (``spec.sizes``)
  are kept, and no length grows.

A reduction is used only if the operator, run once at the reduced lengths, returns exactly the
shapes its annotation gives for them (an operator whose arguments hold literal lengths, say
``arange(16)``, does not, and is verified at its traced lengths instead).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from nnscaler.dimops.binding import BoundAnno
from nnscaler.dimops.partition import Partition, check_partition


def _divisors(bound: BoundAnno, partition: Partition) -> dict[str, int]:
    need: dict[str, int] = {}
    for ident, f in partition.splits:
        if ident is not None:
            need[ident] = need.get(ident, 1) * f * partition.block_count(ident)
    return need


def reduced_sizes(bound: BoundAnno, partition: Partition, fixed=()) -> dict[str, int]:
    """The smallest lengths that keep the order, equalities and divisibility of ``bound.sizes``
    under ``partition`` (``fixed``: identifiers whose length is kept)."""
    need = _divisors(bound, partition)
    sizes = dict(bound.sizes)
    by_length: dict[int, list[str]] = {}
    for ident, n in sizes.items():
        if ident not in fixed and n >= 2:
            by_length.setdefault(n, []).append(ident)
    out = dict(sizes)
    last = 1
    for n in sorted(by_length):
        step = math.lcm(*(need.get(i, 1) for i in by_length[n]))
        m = max(2, last + 1)
        m = -(-m // step) * step  # the next multiple of what each identifier of this length needs
        m = min(m, n)  # never longer than traced (the traced length itself always qualifies)
        for i in by_length[n]:
            out[i] = m
        last = m
    return out


def reduced_bound(spec, bound: BoundAnno, partition: Partition) -> BoundAnno | None:
    """``bound`` at :func:`reduced_sizes` (``None`` when nothing shrinks or the partition does not
    fit the reduced lengths); :func:`fits` then says whether the op agrees with it."""
    sizes = reduced_sizes(bound, partition, fixed=set(spec.sizes))
    if sizes == bound.sizes:
        return None
    small = dataclasses.replace(bound, sizes=sizes)
    try:
        check_partition(small, partition)
    except Exception:  # noqa: BLE001
        return None
    return small


def fits(bound: BoundAnno, outs: tuple) -> bool:
    """Whether ``outs``, the op's results at ``bound``'s lengths, have the shapes the annotation gives."""
    if len(outs) != len(bound.outputs):
        return False
    for dims, y in zip(bound.outputs, outs):
        if dims is None:
            continue
        try:
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != bound.shape(dims):
                return False
        except KeyError:  # an identifier without a length
            return False
    return True
