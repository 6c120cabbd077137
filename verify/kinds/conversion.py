"""The ``conversion`` kind: one layout conversion on these ranks (:mod:`verify.cases.conversion`)."""
from __future__ import annotations

from dataclasses import dataclass

from verify.cases.conversion import run_conversion
from verify.kinds.registry import CaseKind, case_kind


@case_kind("conversion")
@dataclass(frozen=True)
class Conversion(CaseKind):
    """Keys: mesh, shape, src, dst, ids, grad, seed."""

    def run(self, state) -> dict:
        return run_conversion(self.job, state.rank, state.groups)
