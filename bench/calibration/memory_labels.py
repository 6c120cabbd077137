"""What one rank holds at its memory peak, by the operator that allocated each storage and the schedule step.

A :func:`bench.calibration.fake_stage.tracker_class` ``MemTracker`` that labels every storage it sees with the
operator that made it and the step of the pipeline schedule running then (``F<chunk>.<micro-batch>``,
``B<chunk>.<micro-batch>``, ``step``: ``measure_stage`` sets ``tracker.phase``), and keeps the live set at the peak
(re-taken each time the peak grows by more than ``SNAP_STEP`` of the last one taken: the set printed is within that
of the peak). How the gaps of ``bench/results/real_memory.md`` were found.

    python bench/calibration/memory_labels.py llama2-70b --seq 4096 --world 64 --batch 128 \
        --set tp=1 pp=1 dp=64 micro_batch_size=2 num_microbatches=1 zero=3 recompute=full [--stage 0] [--top 25]
"""
from __future__ import annotations

import argparse
import sys
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GiB = 2 ** 30
SNAP_STEP = 0.005  # a new live set once the peak grows by 0.5% of the last one taken


def labelled_tracker():
    """A ``MemTracker`` (ZeRO placeholders skipped) that labels storages and keeps the live set at its peak:
    ``at_peak`` (``[(phase, operator, kind, bytes)]``) and ``peak_total``."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.utils.weak import WeakIdKeyDictionary

    from bench.calibration.fake_stage import tracker_class

    class Labelled(tracker_class()):
        def __init__(self):
            super().__init__()
            self.phase = "build"
            self.labels = WeakIdKeyDictionary()
            self.op = "outside an operator"
            self.at_peak: list = []
            self.peak_total = 0
            self.by_kind: dict = {}  # the phase's first letter (F, B, s: step, b: build) -> (peak, live set)

        def __enter__(self):
            if self._depth == 0:  # MemTracker takes its peak afresh at each entry: so does the live set
                self.peak_total, self.at_peak, self.by_kind = 0, [], {}
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.op = str(func).removeprefix("aten.")
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.op = "outside an operator"

        def _track(self, reftype, t):
            super()._track(reftype, t)
            for st in get_untyped_storages(t):
                if st not in self.labels:  # what made it: the operator, and the first tensor seen on it
                    self.labels[st] = (self.phase, f"{self.op} {str(t.dtype).removeprefix('torch.')}"
                                                   f"{list(t.shape)}")

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            out = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
            for st in get_untyped_storages(t):
                if st not in self.labels:
                    self.labels[st] = (self.phase, f"{reftype}")
            return out

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            total = sum(d.get("Total", 0) for d in self._curr_mem_snap.values())
            kind = self.phase[:1]
            if total > self.by_kind.get(kind, (0, None))[0] * (1 + SNAP_STEP):
                live = [(*self.labels.get(st, ("?", "?")), str(w.reftype).removeprefix("_MemRefType."),
                         w.mem_consumed) for st, (w, _) in self._WINFO.items() if w.mem_consumed]
                self.by_kind[kind] = (total, live)
                if total > self.peak_total:
                    self.peak_total, self.at_peak = total, live
    return Labelled


def summary(at_peak: list, top: int = 25) -> str:
    """The live set at the peak: bytes by phase, by operator kind (phase-less) and the largest (phase, operator)."""
    lines = [f"live at the peak: {sum(b for *_, b in at_peak) / GiB:.2f} GiB in {len(at_peak)} storages"]
    for title, key in (("by kind", lambda p, o, k: k), ("by phase", lambda p, o, k: p),
                       ("by operator", lambda p, o, k: f"{o.split(' ')[0]} [{k}]"), ("by (phase, operator)", lambda p, o, k: f"{p} {o}")):
        agg: dict = defaultdict(lambda: [0, 0])
        for p, o, k, b in at_peak:
            agg[key(p, o, k)][0] += b
            agg[key(p, o, k)][1] += 1
        lines.append(f"-- {title}")
        for name, (b, n) in sorted(agg.items(), key=lambda x: -x[1][0])[:top]:
            lines.append(f"{b / GiB:9.3f} GiB {n:6d}  {name}")
    lines.append("-- the largest storages")
    for p, o, k, b in sorted(at_peak, key=lambda x: -x[3])[:top]:
        lines.append(f"{b / 2**20:9.1f} MiB  {p} {o} [{k}]")
    return "\n".join(lines)


def _value(s: str):
    return {"True": True, "False": False}.get(s, int(s) if s.lstrip("-").isdigit() else s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True, help="global batch in sequences")
    ap.add_argument("--set", nargs="*", default=[], help="constraints KEY=VALUE (tp, pp, dp, zero, recompute, ...)")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--blocks", type=int, nargs="*", help="blocks per chunk (default: the plan's, at most 2)")
    ap.add_argument("--m", type=int, help="micro-batches run (default: as fake_stage.microbatches_run)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    from bench.calibration import fake_stage as fs
    from bench.calibration.real_memory import _short
    from bench.calibration.llama_models import llama_shape
    from nnscaler import ComputeConfig
    from nnscaler.cluster.search import search
    cons = dict(kv.split("=", 1) for kv in args.set)
    cons = {k: _value(v) for k, v in cons.items()}
    plan = search(llama_shape(args.model, args.seq), ComputeConfig(args.world, profile="h100", precision="bf16-mixed",
                                                                   global_batch=args.batch, constraints=cons,
                                                                   mem_budget=2 ** 60), args.model)
    par = plan.parallel
    counts = fs._counts(plan)
    chunks = args.blocks or [min(2, counts[c * par.pp + args.stage]) for c in range(par.virtual_stages)]
    m_eff = args.m or fs.microbatches_run(par)
    tracker = labelled_tracker()()
    got = fs.measure_stage(args.model, par, plan.precision, args.seq, args.stage, chunks, m_eff, tracker=tracker)
    print(f"{_short(par)}  stage {args.stage}, blocks per chunk {chunks}, {m_eff} micro-batches")
    print("measured: " + ", ".join(f"{k} {got[k] / GiB:.2f}" for k in fs.KEYS + ("held",)) + " GiB")
    print(summary(tracker.at_peak, args.top))
    for kind, (total, live) in sorted(tracker.by_kind.items()):
        print(f"\n== the most alive while a phase {kind}... ran: {total / GiB:.2f} GiB")
        print(summary(live, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
