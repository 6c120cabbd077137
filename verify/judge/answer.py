"""What a rank answers to a job: its result, or why it gave none."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RankAnswer:
    """One rank's answer to a job; ``failure`` is set when the rank gave none."""

    rank: int
    result: dict | None = None
    failure: str | None = None
    kind: str | None = None  # "timeout" | "crash" | "memory" | "peer" (stopped after a peer's error)
    exit_code: int | None = None  # a crashed rank's (negative: the signal that killed it)
