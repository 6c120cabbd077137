"""Record the unit times of a ``verify all`` run into ``verify/unit_seconds.json``, the times
``--shard i/N`` balances shares by and the progress ETA counts from (committed: every machine must cut
the same shares).

    python tools/record_unit_times.py reports/ [more report dirs ...]

Times already recorded for units these runs did not hold are kept; a run's cached units count with
their first run's time.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMES = ROOT / "verify" / "unit_seconds.json"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    added = 0
    for d in argv:
        sweep = json.loads((Path(d) / "report.json").read_text()).get("sweep") or {}
        for label, secs in sweep.get("seconds", {}).items():
            times[label] = round(float(secs), 2)
            added += 1
    TIMES.write_text(json.dumps(dict(sorted(times.items())), indent=0) + "\n")
    print(f"{added} unit times from {len(argv)} runs; {len(times)} recorded in {TIMES.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
