"""Pipeline schedules on this CPU, world size 2 (two stages of one rank), nanoGPT, in the same processes:

* bubble fraction per schedule: 1 - (time inside the stages' forward/backward) / (step time), the
  mean over ranks, against (p-1)/(m+p-1) for m in {4, 8, 16} micro-batches (the measured idle time
  also holds the point-to-point transfers and the schedule's own work, which the formula leaves out);
* activations in flight per stage (micro-batches whose forward ran and backward has not): 1F1B holds
  at most p - stage, GPipe m;
* peak activation memory per stage, measured: ``saved_tensors_hooks`` around each stage's forward
  count the bytes of every storage autograd saves for backward (parameters excluded, a storage saved
  twice counted once) while it is held, released when autograd frees it; the peak in bytes, in units
  of one micro-batch's saved bytes (measured alike) against the bound (1F1B p - stage, GPipe m), and
  the ratio GPipe / 1F1B per stage;
* throughput (samples/s) of pp=2 (1F1B, m=8) against dp=2 on the same model and batch.

    python bench/perf/pipeline.py [--layers 4] [--width 128] [--seq 32] [--batch 16] [--steps 4]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import weakref

import torch
import torch.distributed as dist

SCHEDULES = ("GPipe", "1F1B")
MICRO = (4, 8, 16)


class _Probe:
    """Time inside a stage's compute, and micro-batches in flight (forward done, backward not)."""

    def __init__(self, stage):
        self.busy, self.live, self.peak = 0.0, 0, 0
        for name, delta in (("forward_one_chunk", 1), ("backward_one_chunk", -1), ("backward_weight_one_chunk", 0)):
            if hasattr(stage, name):
                setattr(stage, name, self._wrap(getattr(stage, name), delta))

    def _wrap(self, fn, delta):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.busy += time.perf_counter() - t0
                self.live += delta
                self.peak = max(self.peak, self.live)
        return run


class _Held:
    """What a saved tensor is packed into: freed when autograd frees the saved tensor."""

    def __init__(self, t):
        self.t = t


class SavedBytes:
    """Live bytes of the storages autograd holds for backward (saved under :meth:`hooks`), and their
    peak. Parameters' storages are not activations and are left out; a storage is counted once however
    many operators save it."""

    def __init__(self, params=()):
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [holders alive, bytes]
        self.live = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t if isinstance(h, _Held) else h)

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.exclude or not ptr:
            return t
        entry = self.refs.get(ptr)
        if entry is None:
            entry = self.refs[ptr] = [0, t.untyped_storage().nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        held = _Held(t)
        weakref.finalize(held, self._release, ptr)
        return held

    def _release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]


def _measure(stage, params) -> SavedBytes:
    """Count what ``stage`` (a ``PipelineStage``) saves in its forward passes."""
    saved, forward = SavedBytes(params), stage.submod.forward

    def run(*a, **k):
        with saved.hooks():
            return forward(*a, **k)
    stage.submod.forward = run
    return saved


def _one_micro_batch(module, args, params) -> int:
    """The bytes one forward of ``module`` saves for backward (counted as in the schedule)."""
    saved = SavedBytes(params)
    with saved.hooks():
        out = module(*args)
    del out
    return saved.peak


def _rank(rank: int, world: int, args) -> dict:
    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, parallelize
    from verify.models.nanogpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    torch.manual_seed(0)
    base = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 256, (args.batch, args.seq), generator=g),
             torch.randint(0, 256, (args.batch, args.seq), generator=g))
    res = {"bubble": {}, "peak": {}, "act": {}, "unit": {}}
    with tempfile.TemporaryDirectory() as d:
        for sched in SCHEDULES:
            for m in MICRO:
                pc = ComputeConfig(world, pp_size=world, schedule=sched, num_microbatches=m)
                pm = parallelize(copy.deepcopy(base), batch, "dp", pc, gen_savedir=f"{d}/pp{sched}{m}")
                (stage,) = pm._pipe_stages
                probe = _Probe(stage)
                saved = _measure(stage, list(pm.parameters()))
                opt = torch.optim.AdamW(pm.parameters())
                pm.train_step(*batch)  # warm-up
                probe.busy, wall = 0.0, 0.0
                for _ in range(args.steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    pm.train_step(*batch)
                    wall += time.perf_counter() - t0
                    opt.step()
                    opt.zero_grad()
                res["bubble"][(sched, m)] = 1 - probe.busy / wall
                res["peak"][(sched, m)] = probe.peak
                res["act"][(sched, m)] = saved.peak  # over the warm-up and every step
                if sched == SCHEDULES[0]:  # one micro-batch of this m, saved as in the schedule
                    mb = tuple(x[: args.batch // m] for x in batch)
                    stage_mod = next(iter(pm.stages.values()))
                    ins = mb if rank == 0 else tuple(
                        torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.dtype.is_floating_point)
                        for t in pm.graphs[rank].inputs)
                    res["unit"][m] = _one_micro_batch(stage_mod, ins, list(pm.parameters()))
        # throughput: pp=2 (1F1B, m=8) against dp=2, same model and batch, alternating rounds
        pc = ComputeConfig(world, pp_size=world, num_microbatches=8)
        runs = {"pp": parallelize(copy.deepcopy(base), batch, "dp", pc, gen_savedir=f"{d}/tput_pp"),
                "dp": parallelize(copy.deepcopy(base), batch, "dp", ComputeConfig(world), gen_savedir=f"{d}/tput_dp")}
        opts = {k: torch.optim.AdamW(v.parameters()) for k, v in runs.items()}
        times = {k: [] for k in runs}
        for _ in range(args.steps):
            for k, mod in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                if k == "pp":
                    mod.train_step(*batch)
                else:
                    mod(*batch).backward()
                opts[k].step()
                opts[k].zero_grad()
                dist.barrier()
                times[k].append(time.perf_counter() - t0)
        res["throughput"] = {k: args.batch / statistics.median(v) for k, v in times.items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    world = 2
    from verify.runner.spawn import run_ranks
    res = run_ranks(_rank, world, args, timeout_s=3600)
    p_ = world
    print(f"nanoGPT {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}; p={p_} stages")
    print("bubble fraction (mean over ranks) against (p-1)/(m+p-1):")
    for sched in SCHEDULES:
        for m in MICRO:
            got = statistics.mean(res[r]["bubble"][(sched, m)] for r in res)
            want = (p_ - 1) / (m + p_ - 1)
            print(f"  {sched:5s} m={m:2d}: measured {got:.3f}, formula {want:.3f}, ratio {got / want:.2f}")
    print("micro-batches in flight per stage (peak), and peak activation memory GPipe / 1F1B:")
    for m in MICRO:
        flights = {s: [res[r]["peak"][(s, m)] for r in sorted(res)] for s in SCHEDULES}
        ratio = [g / f for g, f in zip(flights["GPipe"], flights["1F1B"])]
        print(f"  m={m:2d}: 1F1B {flights['1F1B']} (bound p - stage = {[p_ - s for s in range(p_)]}), GPipe "
              f"{flights['GPipe']} (m); memory ratio per stage {[round(x, 2) for x in ratio]}")
    print("peak activation memory per stage, measured (saved tensors held for backward): KiB, and in micro-batches "
          "(peak / one micro-batch's saved bytes) against the bound; GPipe / 1F1B:")
    for m in MICRO:
        for r in sorted(res):
            unit = res[r]["unit"][m]
            got = {s: res[r]["act"][(s, m)] for s in SCHEDULES}
            print(f"  m={m:2d} stage {r}: one micro-batch {unit / 1024:.0f} KiB; 1F1B {got['1F1B'] / 1024:.0f} KiB = "
                  f"{got['1F1B'] / unit:.2f} (bound {p_ - r}), GPipe {got['GPipe'] / 1024:.0f} KiB = "
                  f"{got['GPipe'] / unit:.2f} (bound {m}); GPipe / 1F1B {got['GPipe'] / got['1F1B']:.2f}")
    tp = {k: statistics.mean(res[r]["throughput"][k] for r in res) for k in ("pp", "dp")}
    print(f"throughput: pp=2 (1F1B, m=8) {tp['pp']:.1f} samples/s, dp=2 {tp['dp']:.1f} samples/s, "
          f"ratio pp/dp {tp['pp'] / tp['dp']:.2f}")


if __name__ == "__main__":
    main()
