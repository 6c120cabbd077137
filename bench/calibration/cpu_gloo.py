"""The cluster cost model on this machine: estimated (:func:`nnscaler.cluster.cost.estimate`, profile
``cpu-gloo``) vs measured step time of one small Llama (``transformers``, 4 layers, width 128, 4 heads,
sequences of 64 tokens, a global batch of 8) under 14 outer configurations (dp, ZeRO 1 and 3, recompute,
tp with and without sequence parallelism, hybrid tp x dp, 1F1B and interleaved pipelines, pp x dp,
pp x tp) at world sizes 2 and 4, each lowered as ``verify plan`` lowers a saved plan
(:func:`nnscaler.cluster.plan.lower`) and trained on real gloo ranks here (forward, backward,
AdamW step). The plans of one world size train in the same processes, their steps interleaved round by
round so machine noise hits each alike; each plan's time in one set of processes is its fastest step.
The whole measurement is repeated (``repeats``, fresh processes each time, the world sizes taking turns)
and each plan's measured time is the median over the repeats, so one set of processes that met a burst
of load (which moves every plan of a world size against the other's) does not swing the rank order.
Printed by ``bench/calibration/calibrate.py`` with the Spearman rank correlation (goal >= 0.8) and the load average
it ran under.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nnscaler.cluster.cost import Parallel

GLOBAL_BATCH, SEQ, VOCAB = 8, 64, 1024
ARCH = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=SEQ)
PLANS = {  # world size -> the configurations measured in one set of processes
    2: (Parallel(dp=2, micro_batch_size=4),
        Parallel(dp=2, micro_batch_size=4, zero=1),
        Parallel(dp=2, micro_batch_size=4, zero=3),
        Parallel(dp=2, micro_batch_size=4, recompute="full"),
        Parallel(tp=2, micro_batch_size=8),
        Parallel(tp=2, micro_batch_size=8, sequence_parallel=True),
        Parallel(pp=2, micro_batch_size=2, num_microbatches=4),
        Parallel(pp=2, micro_batch_size=2, num_microbatches=4, virtual_stages=2)),
    4: (Parallel(dp=4, micro_batch_size=2),
        Parallel(dp=4, micro_batch_size=2, zero=3, recompute="full"),
        Parallel(tp=4, micro_batch_size=8),
        Parallel(tp=2, dp=2, micro_batch_size=4),
        Parallel(pp=2, dp=2, micro_batch_size=2, num_microbatches=2),
        Parallel(pp=2, tp=2, micro_batch_size=2, num_microbatches=4)),
}


def label(p: Parallel) -> str:
    v = f" v{p.virtual_stages}" if p.virtual_stages > 1 else ""
    return (f"tp{p.tp}{'+sp' if p.sequence_parallel else ''} pp{p.pp}{v}"
            f" dp{p.dp} mbs{p.micro_batch_size}x{p.num_microbatches} zero{p.zero} {p.recompute}")


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, float)
        r = np.empty(len(x))
        r[x.argsort()] = np.arange(len(x))
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def _model(device: str | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    from verify.models.common import LossOf, causal_lm
    with torch.device(device or "cpu"):
        return LossOf(causal_lm(LlamaForCausalLM(LlamaConfig(**ARCH, attn_implementation="sdpa", use_cache=False))))


def shape():
    """The model read as repeated blocks by the cluster planner (traced on meta, one sequence)."""
    from nnscaler.cluster.search import trace_shape
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_shape(_model("meta"), (ids, ids))


def _rank(rank: int, world: int, port: int, steps: int, out_path: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import opzoo  # noqa: F401  (registers the operator annotations)
    from nnscaler import parallelize
    from nnscaler.cluster.plan import lower
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    batch = (ids, ids.clone())
    runs = []
    with tempfile.TemporaryDirectory() as d:
        for i, par in enumerate(PLANS[world]):
            torch.manual_seed(0)
            policy, cfg = lower(par, "32-true", seed=0)
            with contextlib.redirect_stdout(io.StringIO()):
                pm = parallelize(_model(), batch, policy, cfg, gen_savedir=f"{d}/p{i}", verify=False)
            stepped = cfg.pp_size > 1 or cfg.num_microbatches > 1
            runs.append((par, pm, pm.build_optimizer(torch.optim.AdamW, lr=1e-4), stepped, []))
        for round_ in range(steps + 2):  # the first two rounds warm up allocators and gloo
            for par, pm, opt, stepped, times in runs:
                dist.barrier()
                t0 = time.perf_counter()
                if stepped:
                    pm.train_step(*batch)
                else:
                    pm(*batch).backward()
                opt.step()
                opt.zero_grad()
                dist.barrier()
                if round_ >= 2:
                    times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump([min(t) for *_, t in runs], f)
    dist.destroy_process_group()


def measure(steps: int = 6, repeats: int = 3) -> list[tuple[Parallel, float, float]]:
    """``(configuration, median over repeats of its fastest step, spread)`` of every plan of :data:`PLANS`
    on real gloo ranks; ``spread``: (slowest - fastest repeat) / median."""
    from verify.runner.gang import free_port
    seen: dict[Parallel, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for world, plans in PLANS.items():
                path = os.path.join(tmp, f"w{world}-{r}.json")
                mp.spawn(_rank, args=(world, free_port(), steps, path), nprocs=world)
                with open(path) as f:
                    for par, took in zip(plans, json.load(f)):
                        seen.setdefault(par, []).append(took)
    out = []
    for par, times in seen.items():
        mid = statistics.median(times)
        out.append((par, mid, (max(times) - min(times)) / mid))
    return out


def table(steps: int = 6, profile=None, repeats: int = 3) -> float:
    """Print estimated vs measured per plan and the Spearman rank correlation; return it."""
    from nnscaler.cluster.cost import estimate
    from nnscaler.profiles import get_profile
    prof = profile or get_profile("cpu-gloo")
    sh = shape()
    load0 = os.getloadavg()
    measured = measure(steps, repeats)
    load1 = os.getloadavg()
    rows = [(par, estimate(sh, par, prof, "32-true", GLOBAL_BATCH).step_seconds, took, spread)
            for par, took, spread in measured]
    print(f"cpu-gloo: estimated vs measured step time, Llama 4 x 128 (seq {SEQ}, batch {GLOBAL_BATCH}), fp32, "
          f"median over {repeats} sets of processes of the fastest of {steps} interleaved steps on real gloo ranks "
          f"here; load average {load0[0]:.1f} before, {load1[0]:.1f} after ({os.cpu_count()} cores)")
    print(f"{'W':>2} {'configuration':<42} {'estimated':>10} {'measured':>10} {'est/meas':>8} {'spread':>7}")
    for par, est, took, spread in rows:
        print(f"{par.world:>2} {label(par):<42} {est * 1e3:>8.1f}ms {took * 1e3:>8.1f}ms {est / took:>8.2f} "
              f"{100 * spread:>6.0f}%")
    rho = spearman([e for _, e, _, _ in rows], [m for _, _, m, _ in rows])
    per_w = {w: spearman([e for p, e, _, _ in rows if p.world == w], [m for p, _, m, _ in rows if p.world == w])
             for w in PLANS}
    print(f"{len(rows)} plans: Spearman rank correlation estimated vs measured {rho:.3f} (goal >= 0.8); within one "
          f"world size (the same processes, steps interleaved): "
          + ", ".join(f"W={w} {r:.3f}" for w, r in per_w.items()))
    return rho
