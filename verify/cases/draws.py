"""Random draws made equal: a training forward that draws random numbers (dropout) is verifiable
when the parallel program and its single-device references draw the same numbers.

Every forward of one step runs from the same generator state (:func:`same_draws`), and an operator
that draws runs whole on every rank (dropout has no annotation: its input is gathered, so each rank
draws the whole tensor's mask from that state and keeps what it needs). The masks then equal one
device's bit for bit, in float32 and float64 alike (CPU ``bernoulli_`` draws in double whatever the
tensor's dtype), and ``torch.utils.checkpoint`` restores the state for a recompute.

That holds only where each rank's program sees the single device's whole batch at once: micro-batches
(and so pipelines) and data-parallel replicas draw per piece of the batch, so there a program that
draws stays ``unverifiable`` (:func:`verify.judge.verdict.check_deterministic`).

The float64 reference that sets the bounds draws as the run in the dtype under test did, from the
same state (recorded around that run: :mod:`verify.judge.draw_record`), so a bound never widens
because of a draw; where it cannot, :func:`check_draws` makes the row ``unverifiable``."""
from __future__ import annotations

import contextlib

import torch

from verify.judge.verdict import Unverifiable


@contextlib.contextmanager
def same_draws(seed: int, step: int):
    """Run the block from the generator state of (``seed``, ``step``), leaving the caller's state as
    it was: each forward of a step (parallel, float32 and float64 references) draws the same numbers."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed((seed * 1_000_003 + step) % 2 ** 63)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed_all((seed * 1_000_003 + step) % 2 ** 63)
        yield



def check_draws(fallback) -> None:
    """Raise :class:`~verify.judge.verdict.Unverifiable` naming every call the float64 reference of
    ``fallback`` (a :class:`~verify.judge.compare.Float64Fallback`) could not draw as the run did."""
    problems = fallback.draws.problems
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise Unverifiable(f"random draws that cannot be made equal in the float64 reference: "
                           f"{'; '.join(problems[:3])}{more}")
