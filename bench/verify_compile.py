"""Compile only what passed, timed: GPT-2 small (12 layers x 768, vocab 50304, nanoGPT's layout) under
``tp`` at W=2 on gloo. Prints the compile time without verification (the baseline), with it on an
empty cache (cold) and with the cache filled (warm), each as a ratio against the baseline, in the
same run.

    python bench/verify_compile.py          # spawns 2 ranks with torchrun
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path


def _rank_main(out: Path) -> None:
    import torch
    import torch.distributed as dist

    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, parallelize
    from verify.models.nanogpt import GPT, GPTConfig
    from verify.plan_check import plan_pairs

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=64, n_layer=12, n_head=12, n_embd=768))
    idx = torch.randint(0, 50304, (2, 64))
    args = (idx, idx)
    times = {}
    for label, verify in (("baseline", False), ("cold", "strict"), ("warm", "strict")):
        dist.barrier()
        t0 = time.perf_counter()
        pm = parallelize(model, args, "tp", ComputeConfig(2), gen_savedir=out / label, verify=verify,
                         verify_cache=out / "verdicts.json")
        dist.barrier()
        times[label] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        pairs = len(plan_pairs(pm.graph, pm.plan, "float32"))
        base = times["baseline"]
        print(f"GPT-2 small, tp, W=2: {len(pm.graph.ops)} operators, {pairs} distinct (operator, partition) pairs")
        print(f"  compile without verification {base:6.2f} s  (1.00x)")
        for k in ("cold", "warm"):
            print(f"  compile + verify, {k} cache  {times[k]:6.2f} s  ({times[k] / base:.2f}x); "
                  f"verification alone {times[k] - base:6.2f} s")
    dist.destroy_process_group()


def main() -> None:
    from verify.gang import free_port
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                        "127.0.0.1", "--master_port", str(free_port()), __file__, "--rank", tmp], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    if "--rank" in sys.argv:
        _rank_main(Path(sys.argv[-1]))
    else:
        main()
