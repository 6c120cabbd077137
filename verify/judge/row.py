"""One case's verdict (:class:`Row`): what the report, the cache and the rerun line are made of."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from verify.judge.verdict import MATCH


@dataclass
class Row:
    """The verdict of one case."""

    op: str
    family: str
    annotation: str
    world_size: int
    partition: str
    dtype: str
    seed: int
    status: str
    out_err: float | None = None
    out_tol: float | None = None
    grad_err: float | None = None
    grad_tol: float | None = None
    detail: str = ""
    rerun: str = ""
    seconds: float = 0.0
    traceback: str = field(default="", repr=False)
    microbatches: int = 1  # whole-model rows: micro-batches per step (the partition label says so too)
    memory: list | None = None  # whole-model rows: bytes per rank measured after the last step (verify/cases/memory.py)
    localization: dict | None = None  # mismatching model rows: divergence, note, profile (verify.judge.verdict.localization)
    cached: bool = False  # the verdict was reused from the verdict cache (verify/sweep/cache.py), not run again

    @property
    def ok(self) -> bool:
        return self.status == MATCH

    @property
    def case_label(self) -> str:
        """``W=2 [m=2]``; ``sampling`` for the row of an op whose sample could not be made (no world size)."""
        return f"W={self.world_size} [{self.partition}]" if self.world_size else "sampling"

    @property
    def key(self) -> tuple:
        return (self.op, self.world_size, self.partition, self.dtype, self.seed)

    def to_json(self) -> dict:
        return asdict(self)
