"""Compile only what passed, timed: GPT-2 small (12 layers x 768, vocab 50304, nanoGPT's layout) under
``tp`` at W=2 on gloo.

Prints, in one run: the compile time without verification (the baseline, after one warm-up compile
so torch.export's first-call costs are not counted), with verification on an empty cache (cold) and
on the filled cache (warm), each as a ratio against the baseline; and the verification alone
(``verify.plan.check.verify_plan`` on the compiled plan), cold and warm. ``--unreduced`` also times
verifying every (operator, partition) pair at its traced lengths (what :mod:`verify.plan.shrink`
saves; minutes here: the 50304-wide embedding and LM head in float64).

    python bench/perf/verify_compile.py [--unreduced]     # spawns 2 ranks with torchrun (loopback)
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path


def _rank_main(out: Path, unreduced: bool) -> None:
    import torch
    import torch.distributed as dist

    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, parallelize
    from verify.models.nanogpt import GPT, GPTConfig
    from verify.plan.check import plan_pairs, verify_plan

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=64, n_layer=12, n_head=12, n_embd=768))
    idx = torch.randint(0, 50304, (2, 64))
    args = (idx, idx)

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        return time.perf_counter() - t0, result

    times = {}
    for label, verify in (("warm-up", False), ("baseline", False), ("cold", "strict"), ("warm", "strict")):
        times[label], pm = timed(lambda: parallelize(model, args, "tp", ComputeConfig(2), gen_savedir=out / label,
                                                     verify=verify, verify_cache=out / "verdicts.json"))
    alone = {}
    for label in ("cold", "warm"):
        alone[label], verdicts = timed(lambda: verify_plan(pm.graph, pm.plan, cache_path=out / "alone.json"))
        assert all(v.ok for v in verdicts), [v for v in verdicts if not v.ok]
    if unreduced:
        alone["unreduced"], _ = timed(lambda: verify_plan(pm.graph, pm.plan, cache_path=out / "full.json",
                                                          reduce=False))
    if dist.get_rank() == 0:
        pairs = plan_pairs(pm.graph, pm.plan, "float32")
        reduced = sum(p.small is not None for p in pairs.values())
        base = times["baseline"]
        print(f"GPT-2 small, tp, W=2: {len(pm.graph.ops)} operators, {len(pairs)} distinct (operator, partition) "
              f"pairs, {reduced} verified at reduced lengths")
        print(f"  compile without verification {base:6.2f} s  (1.00x)")
        for k in ("cold", "warm"):
            print(f"  compile + verify, {k} cache  {times[k]:6.2f} s  ({times[k] / base:.2f}x)")
        for k, t in alone.items():
            print(f"  verification alone, {k:<9} {t:6.2f} s  ({t / base:.2f}x of the compile)")
    dist.destroy_process_group()


def main() -> None:
    from verify.torchrun import command
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--unreduced"] if "--unreduced" in sys.argv else []
        subprocess.run(command(["--nproc_per_node", "2", __file__, "--rank", tmp, *extra]), check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    if "--rank" in sys.argv:
        _rank_main(Path(sys.argv[sys.argv.index("--rank") + 1]), "--unreduced" in sys.argv)
    else:
        main()
