"""Cluster planning time, the way it was against the way it is, in one run: Llama-3 70B (and 405B) on
the meta device, H100 profile, bf16-mixed, seq 4096 (405B: 8192), 8k tokens per GPU per step.

* before: the whole model traced (every block through ``torch.export``) and every candidate costed from
  its sections (``estimate`` with no memo);
* after: :func:`nnscaler.cluster.trace.trace_shape` (two blocks traced, extended to the real
  count) and :func:`nnscaler.cluster.search.search` (each (tp, sp, micro-batch size, recompute) costs
  its sections once, the stage split found by bisection per form).

Both must choose the same configuration with the same estimate (checked). The "before" search already
has the new stage split (``layer_split``), so the search ratio understates the change; the old one is kept
as a reference in ``tests/compiler/test_cluster.py``.

    python bench/perf/plan_time.py [--worlds 64 1024] [--with-405b]
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _whole_shape(model, ids):
    from nnscaler.compile.plan import trace_model
    from nnscaler.cluster.blocks import model_shape
    graph = trace_model(model, (ids, ids), None, registry=None, strict=False)
    return model_shape(graph, int(ids.shape[0]), int(ids.shape[1]))


def _plain_search(shape, cfg):
    """The search loop as it was: every candidate costed from scratch."""
    from nnscaler.cluster.cost import estimate
    from nnscaler.profiles import get_profile
    from nnscaler.cluster.search import candidates
    prof = get_profile(cfg.profile)
    best = None
    for par in candidates(shape, cfg.plan_ngpus, cfg.global_batch, {}, prof.ranks_per_node):
        e = estimate(shape, par, prof, cfg.precision, cfg.global_batch, cfg.mem_budget)
        if e.fits and (best is None or e.step_seconds < best.step_seconds):
            best = e
    return best


def row(name: str, seq: int, worlds) -> None:
    import opzoo  # noqa: F401
    from bench.calibration.llama_models import llama_model
    from nnscaler import ComputeConfig
    from nnscaler.cluster.search import search
    from nnscaler.cluster.trace import trace_shape
    model, ids = llama_model(name, seq)
    t0 = time.perf_counter()  # the short trace first: it pays the process's first-export warm-up
    short = trace_shape(model, (ids, ids))
    t_short = time.perf_counter() - t0
    t0 = time.perf_counter()
    whole = _whole_shape(model, ids)
    t_whole = time.perf_counter() - t0
    print(f"{name} seq {seq}: meta trace {t_whole:.1f} s whole ({whole.layers} blocks) -> {t_short:.1f} s "
          f"(2 blocks): x{t_whole / t_short:.1f}", flush=True)
    for w in worlds:
        cfg = ComputeConfig(w, profile="h100", precision="bf16-mixed", global_batch=w * 8192 // seq)
        t0 = time.perf_counter()
        old = _plain_search(whole, cfg)
        t_old = time.perf_counter() - t0
        t0 = time.perf_counter()
        new = search(short, cfg, name)
        t_new = time.perf_counter() - t0
        assert new.best.parallel == old.parallel and abs(new.best.step_seconds / old.step_seconds - 1) < 1e-9, \
            (new.best.parallel, old.parallel)
        p = new.parallel
        print(f"  {w:>5} GPUs: search {t_old:.2f} s -> {t_new:.2f} s (x{t_old / t_new:.1f}, {new.considered} "
              f"candidates); trace + search {t_whole + t_old:.1f} s -> {t_short + t_new:.1f} s "
              f"(x{(t_whole + t_old) / (t_short + t_new):.1f}); same plan: tp{p.tp} pp{p.pp} v{p.virtual_stages} "
              f"dp{p.dp} mbs{p.micro_batch_size} x{p.num_microbatches} zero{p.zero} {p.recompute}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--with-405b", action="store_true", help="also 405B on 8192 GPUs at seq 8192 (goal < 5 min)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    row("llama3-70b", 4096, args.worlds)
    if args.with_405b:
        row("llama3-405b", 8192, [8192])


if __name__ == "__main__":
    main()
