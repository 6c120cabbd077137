"""The real-size memory measurements on record, ``bench/results/real_memory.json``: what
``bench/calibration/real_memory.py`` measured for each plan (minutes to half an hour a plan here), kept by label with
the configuration measured, so that ``bench/calibration/autodist.py`` shows every plan's measured memory against the
estimate of today without measuring again, and says where a plan is unmeasured or was measured in another
configuration (the search moves plans when the cost model changes)."""
from __future__ import annotations

import json
import time
from pathlib import Path

RECORD = Path(__file__).resolve().parents[2] / "bench" / "results" / "real_memory.json"


def load(path: Path = RECORD) -> dict:
    """``{label: {"parallel", "measured", "extrapolated", "date"}}``; empty where nothing is on record."""
    return json.loads(path.read_text()) if path.exists() else {}


def put(label: str, plan, got: dict, extrapolated: bool, path: Path = RECORD) -> None:
    """Record ``got`` (bytes per :data:`~bench.calibration.fake_stage.KEYS`, and ``held``) measured for ``plan``
    under ``label``, replacing what was on record for that label."""
    rec = load(path)
    rec[label] = {"parallel": plan.parallel.as_dict(), "measured": got, "extrapolated": extrapolated,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path.write_text(json.dumps(dict(sorted(rec.items())), indent=1) + "\n")


def measured_for(label: str, plan, path: Path = RECORD) -> tuple[dict | None, str]:
    """``(measured bytes, "")`` where the record holds ``label`` in ``plan``'s configuration, else ``(None, why
    not)``."""
    rec = load(path).get(label)
    rerun = f"python bench/calibration/real_memory.py --extrapolate --plans {label}"
    if rec is None:
        return None, f"not measured at real size ({rerun})"
    if rec["parallel"] != plan.parallel.as_dict():
        return None, f"measured {rec['date']} in another configuration, not this one ({rerun})"
    return rec["measured"], ""
