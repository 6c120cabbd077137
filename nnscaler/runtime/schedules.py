"""The pipeline schedules, by name: classes of :mod:`torch.distributed.pipelining`.

``GPipe`` and ``1F1B`` run one stage per rank; ``Interleaved1F1B`` and ``InterleavedZeroBubble`` run
:data:`VIRTUAL_STAGES` stages per rank (stage ``s`` on pipeline rank ``s % pp_size``).
"""
from __future__ import annotations

from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "InterleavedZeroBubble": ScheduleInterleavedZeroBubble}
VIRTUAL_STAGES = 2  # stages per rank of the interleaved schedules


def canonical_schedule(name: str) -> str | None:
    """The schedule's name as :data:`SCHEDULES` spells it (case-insensitive), or ``None``."""
    return next((k for k in SCHEDULES if k.lower() == str(name).lower()), None)


def stages_per_rank(schedule: str) -> int:
    return VIRTUAL_STAGES if canonical_schedule(schedule).startswith("Interleaved") else 1
