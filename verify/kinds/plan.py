"""The ``plan`` kind: a saved cluster plan as ``python -m verify plan FILE`` runs it (``verify/plan/cli.py``):
reduced, lowered, and on the ranks a whole-model case of its lowered layout (the ``model`` kind's run). In
the sweep, one saved plan file at the world size it reduces to; its file's content keys its verdicts."""
from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from pathlib import Path

from verify.config import RunConfig
from verify.kinds.model import Model
from verify.kinds.registry import case_kind


def file_digest(path: Path) -> str:
    """The sha256 of the file's bytes (``"missing"`` where it cannot be read)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "missing"


@case_kind("plan")
@dataclass(frozen=True)
class Plan(Model):
    """Keys (on a rank): those of a ``model`` job with the plan's ``layout``."""

    @classmethod
    def label(cls, unit) -> str:
        return f"plan:{Path(unit.name).stem} W={unit.world_sizes[0]} seed {unit.seeds[0]}"

    @classmethod
    def rerun_command(cls, cfg: RunConfig, path, as_planned: bool = False, precision: str | None = None) -> str:
        """``python -m verify plan PATH`` (``--as-planned``, ``--precision``, then ``cfg``'s ``--module`` files)."""
        parts = ["python", "-m", "verify", "plan", str(path)] + (["--as-planned"] if as_planned else []) \
            + (["--precision", precision] if precision else []) + [x for m in cfg.modules for x in ("--module", m)]
        return " ".join(shlex.quote(x) for x in parts)

    @classmethod
    def cache_key(cls, unit, root: Path) -> dict:
        """The unit, and its plan file's content (an edited plan reruns)."""
        return {**super().cache_key(unit, root), "plan": file_digest(root / unit.name)}
