"""Failing gradient checks explained by values that took the other side of a kink, or not.

A function with a kink (``relu``, ``clamp``, ``abs``, ``maximum``/``minimum``, a comparison) is not
differentiable there: where a pre-activation lies within a rounding of the kink, a correct program that
rounds elsewhere (a tensor-parallel partial sum) may land on the other side, and every gradient
downstream of that element moves by a whole term (the element's incoming gradient times its input),
far above rounding, while the forward moves by the rounding alone. The single-device run gives no bound
for such a term, so a correct program could fail there.

What a flip does is computable: the single-device model run with that one value put on the kink's
other side gives its exact contribution ``c_u`` to every gradient (:mod:`verify.cases.kinks`). A
parallel program's gradients are explained by kinks when, for some set ``S`` of the near-kink values,
its gradients minus ``sum(c_u for u in S)`` pass every check of the step at the usual bounds
(:func:`explain`). A wrong program's error is not such a sum (a wrong annotation moves gradients by
the tensor's own size, in no pattern of a few flipped values), so it still fails; the bound itself is
never widened. Unlike a sample with every near-kink flipped at once, whose error would have to widen
every bound of the step, this keeps the bounds exactly where they were."""
from __future__ import annotations

from typing import Callable

import torch

from verify.judge.compare import Check


def worst(checks: list[Check]) -> float:
    """The largest ``err / tol`` of ``checks`` (:attr:`Check.ratio`)."""
    return max((c.ratio for c in checks), default=0.0)


def explain(grads: dict[str, torch.Tensor | None], judge: Callable[[str, torch.Tensor | None], Check],
            contributions: list[dict[str, torch.Tensor | None]]) -> tuple[list[int], list[Check]]:
    """The smallest set of flips found (indices into ``contributions``, greedily: each round adds the
    flip that lowers the step's worst ``err / tol`` most, until none lowers it or every check passes)
    and the checks of ``grads`` (the parallel gradients, by name) with those flips' contributions taken
    off, judged by ``judge(name, corrected)``. Every gradient of the step is judged with the same set:
    a flip that mends one tensor and breaks another is no explanation."""
    def checks_of(chosen: list[int]) -> list[Check]:
        out = []
        for name, g in grads.items():
            if g is not None:
                for i in chosen:
                    c = contributions[i].get(name)
                    if c is not None and c.shape == g.shape:
                        g = g - c.to(g.dtype)
            out.append(judge(name, g))
        return out

    chosen: list[int] = []
    best = checks_of(chosen)
    while not all(c.ok for c in best):
        trials = [(worst(t), i, t) for i in range(len(contributions)) if i not in chosen
                  for t in [checks_of(chosen + [i])]]
        if not trials:
            break
        score, i, t = min(trials, key=lambda x: x[0])
        if score >= worst(best):
            break
        chosen.append(i)
        best = t
    return chosen, best
