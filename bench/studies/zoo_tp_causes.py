"""Why the attention models of ``reports/zoo.json`` over Megatron's bar under ``tp`` (more than 2 forward
collectives per layer plus 4, W=2) are over it: the plan report's forward collectives by cause
(:func:`nnscaler.cost.causes.forward_causes`), one line per cause, per model.

    python bench/studies/zoo_tp_causes.py [--json reports/zoo.json] [--archs A B ...] [--md reports/zoo_tp_causes.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [p for p in (str(ROOT),) if p not in sys.path]


def over_bar(rows: dict) -> list[str]:
    """The attention models whose tp plan issues more than 2 forward collectives per layer plus 4."""
    return [a for a, r in rows.items() if r.get("attn") and "tp_fwd" in r and r.get("layers")
            and r["tp_fwd"] > 2 * r["layers"] + 4]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(ROOT / "reports" / "zoo.json"))
    ap.add_argument("--archs", nargs="+", help="these instead of those over the bar in --json")
    ap.add_argument("--md", default=str(ROOT / "reports" / "zoo_tp_causes.md"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import opzoo  # noqa: F401  (the operator rules)
    from nnscaler.compile.plan import plan_graph, trace_model
    from nnscaler.config import ComputeConfig
    from nnscaler.cost.causes import forward_causes
    from nnscaler.policies.tp_check import collectives, layer_runs
    from verify.models.zoo import build
    rows = json.loads(Path(args.json).read_text())
    archs = args.archs or over_bar(rows)
    out = ["# Why tp stays over Megatron's bar (W=2): forward collectives by cause", "",
           f"    python bench/studies/zoo_tp_causes.py {' '.join(sys.argv[1:])}".rstrip(),
           f"    ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {len(archs)} architectures)", ""]
    for arch in archs:
        case = build(arch, 0, 2)  # as bench/studies/zoo.py builds it (--kv-heads 2)
        graph = trace_model(case.model, case.batch(0), None, registry=None, strict=False)
        plan = plan_graph(graph, "tp", ComputeConfig(2))
        n, layers = sum(collectives(graph, plan, params=False)[0].values()), layer_runs(graph)
        out += [f"## {arch}: {n} forward collectives, {layers} layers (bar {2 * layers + 4})", ""]
        out += [f"- {c}" for c in forward_causes(graph, plan)] + [""]
        print(arch, n, flush=True)
    Path(args.md).write_text("\n".join(out))


if __name__ == "__main__":
    main()
