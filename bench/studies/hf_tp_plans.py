"""transformers' own tensor-parallel plans across the zoo: every architecture of the pinned version whose
config declares a ``base_model_tp_plan``, its tiny model (``verify.models.zoo``) parallelized by
``tp_plan="auto"`` (``verify/models/torch_plans.py:hf_tp_auto``: the plan resolved and applied as
``from_pretrained(..., tp_plan="auto")`` does) and trained 2 AdamW steps on real ranks against one
device by the harness's torch-parallelization case, with a DCP resume, at W=2 (2 of 4 heads per
key/value head: the zoo's GQA) and W=4 (as many key/value heads as heads, so the plan's head split
divides).

    python bench/studies/hf_tp_plans.py [--archs llama qwen3 ...] [--world-sizes 2 4] [--resume [--redo error ...]] \\
        [--md reports/hf_tp_plans.md] [--json reports/hf_tp_plans.json]

Each (architecture, world size) is one row: ``match`` (the plan is right), ``MISMATCH`` (the plan, or
transformers' code under it, is wrong: the row names the first module that parts from one device),
``error`` (the plan cannot be applied or run: the row says where), or ``build`` (the tiny model does
not build). The JSON is written after every row: ``--resume`` goes on where a cut-off sweep stopped.
``base_model_pp_plan`` (pipelines) is not swept: ``--parallelize`` takes no pipeline stages yet.

Model references for the ranks: ``zoo:<arch>`` at W=2; at W=4 this file's ``kv4_<arch>`` builders
(module ``__getattr__``), the same tiny model with 4 key/value heads.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PLAN = ROOT / "verify" / "models" / "torch_plans.py"
STEPS = 2
KV4 = "kv4_"


def __getattr__(name: str):
    """``kv4_<arch>``: the builder ``seed -> ModelCase`` of ``arch``'s tiny model with 4 key/value heads."""
    if not name.startswith(KV4):
        raise AttributeError(name)
    from verify.models.zoo import build
    arch = name[len(KV4):]

    def builder(seed: int):
        return build(arch, seed, kv_heads=4)
    builder.__name__ = name
    return builder


def planned_archs() -> list[str]:
    """The zoo's model types whose config declares a ``base_model_tp_plan``, sorted."""
    import warnings
    from transformers import AutoConfig
    from verify.models.zoo import KINDS, archs_of
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in KINDS:
            for arch in archs_of(kind):
                try:
                    if getattr(AutoConfig.for_model(arch), "base_model_tp_plan", None):
                        out.append(arch)
                except Exception:  # noqa: BLE001  (a config that cannot be made has no plan to sweep)
                    continue
    return sorted(set(out))


def model_ref(arch: str, world: int) -> str:
    return f"zoo:{arch}" if world == 2 else f"{Path(__file__).resolve()}:{KV4}{arch}"


def sweep(archs: list[str], world: int, rows: dict, timeout_s: float, save) -> None:
    """One gang of ``world`` ranks; ``rows[arch][str(world)]``: ``{"status", "detail", "seconds"}``."""
    from verify.config import RunConfig
    from verify.rows.torchpar import run_torchpar
    from verify.runner.gang import Gang
    cfg = RunConfig(world_sizes=(world,), seeds=(0,), timeout_s=timeout_s)
    with tempfile.TemporaryDirectory() as tmp, Gang(world, (), (world,),
                                                    pg_timeout_s=max(300.0, 2 * cfg.limit_s("model", STEPS))) as gang:
        for arch in archs:
            t0 = time.perf_counter()
            try:
                got = list(run_torchpar(gang, model_ref(arch, world), f"{PLAN}:hf_tp_auto", (("tp", world),), cfg, tmp,
                                        STEPS, label=f"tp_plan=auto [tp={world}]"))
                status, detail = got[0].status, got[0].detail or ""
            except Exception as exc:  # noqa: BLE001  (a model that does not build: its row says so)
                status, detail = "build", f"{type(exc).__name__}: {exc}"
            rows.setdefault(arch, {})[str(world)] = {"status": status, "detail": " ".join(detail.split()),
                                                     "seconds": round(time.perf_counter() - t0, 1)}
            print(f"  {arch} W={world}: {status} {detail.splitlines()[0][:120] if detail else ''}", flush=True)
            save()


def kind(c: dict) -> str:
    """A row's class: its status, or ``trained like one device, resume raised`` for an error whose every training
    check passed before the checkpoint resume raised (the resume alone unverified)."""
    m = re.search(r"the checkpoint resume raised .*; before it, (\d+) of (\d+) checks passed$", c["detail"])
    return "trained like one device, resume raised" if c["status"] == "error" and m and m[1] == m[2] else c["status"]


def cell(c: dict) -> str:
    """A row's table cell: its status, the first words of why, and what was judged before an exception."""
    if c["status"] == "match":
        return "match"
    detail = c["detail"]
    before = detail[detail.find("; before it, ") + 2:] if "; before it, " in detail else ""
    return f"{c['status']}: {detail[:160]}{' ... ' + before[:220] if before else ''}".replace("|", "/")


def report(rows: dict, worlds: list[int], command: str) -> str:
    counts = {w: Counter(kind(r[str(w)]) for r in rows.values() if str(w) in r) for w in worlds}
    out = [f"# bench/studies/hf_tp_plans.py: transformers' tp_plan=\"auto\" on {len(rows)} architectures of the zoo", "",
           f"    {command}", "",
           "Each architecture whose config declares a `base_model_tp_plan`, its tiny model parallelized by transformers' "
           f"own plan and trained {STEPS} AdamW steps against one device (loss, every gradient, the update, a DCP resume).",
           ""]
    out += [f"- W={w}: " + ", ".join(f"{n} {s}" for s, n in counts[w].most_common()) for w in worlds]
    out += ["", "| arch | " + " | ".join(f"W={w}" for w in worlds) + " |", "|---|" + "---|" * len(worlds)]
    for arch, r in rows.items():
        cells = []
        for w in worlds:
            c = r.get(str(w))
            cells.append("not run" if c is None else cell(c))
        out.append(f"| {arch} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", help="these model types (default: every one with a base_model_tp_plan)")
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4], choices=(2, 4))
    ap.add_argument("--resume", action="store_true", help="keep the finished rows of --json")
    ap.add_argument("--redo", nargs="+", default=[], metavar="STATUS_OR_ARCH",
                    help="with --resume: these architectures afresh, or every row of these statuses (e.g. error)")
    ap.add_argument("--timeout", type=float, default=30.0, help="the harness's case timeout (a model case gets 8x)")
    ap.add_argument("--md", default=str(ROOT / "reports" / "hf_tp_plans.md"))
    ap.add_argument("--json", default=str(ROOT / "reports" / "hf_tp_plans.json"))
    args = ap.parse_args()
    archs = args.archs or planned_archs()
    jpath = Path(args.json)
    rows: dict = json.loads(jpath.read_text()) if args.resume and jpath.is_file() else {}
    for arch, r in rows.items():
        for w in list(r):
            if arch in args.redo or r[w]["status"] in args.redo:
                del r[w]

    def save():
        jpath.parent.mkdir(parents=True, exist_ok=True)
        jpath.write_text(json.dumps(rows, indent=1))

    for w in args.world_sizes:
        todo = [a for a in archs if str(w) not in rows.get(a, {})]
        print(f"W={w}: {len(todo)} architectures", flush=True)
        if todo:
            sweep(todo, w, rows, args.timeout, save)
    command = "python bench/studies/hf_tp_plans.py " + " ".join(sys.argv[1:])
    text = report({a: rows[a] for a in archs if a in rows}, args.world_sizes, command)
    Path(args.md).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
