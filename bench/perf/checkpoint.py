"""Save and load time of nnscaler's sharded checkpoint (model and AdamW state, ``nnscaler.checkpoint``)
against ``torch.distributed.checkpoint`` called directly on the same tensors, in the same processes
(alternating, several repeats), and the peak memory a rank adds while saving against the size of its
shard.

    python bench/perf/checkpoint.py [--world 2] [--policy tp] [--layers 4] [--width 256] [--repeats 5]

The baseline saves and loads each rank's pieces as ``DTensor``s built with torch's own API (a
``DeviceMesh`` over the plan's ranks; a piece split in blocks, such as a fused qkv weight's, as a
plain ``Shard``): what a hand-written DCP checkpoint of this state costs. nnscaler adds names and
whole shapes from the plan, its metadata file, the optimizer's hyperparameters and checks; a load
reshards to any plan. Memory is the rank's resident set size, sampled every millisecond during the
save, above what it was just before (the allocator set to return freed blocks at once). Goal: time ratio close to 1; peak added memory well under the
shard's size (no rank gathers the model).
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The largest resident set size above the starting one while the ``with`` block runs."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.added = self.peak - self.start


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _baseline_state(pm, opt, mesh) -> dict:
    """The same pieces as DTensors, built with torch's API from the plan's layouts."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    state = {}
    for key, name in pm._names.items():
        shape, layout, _, _ = pm._program.STATE[name]
        local = getattr(pm, key).detach()
        places = [Shard(int(q[1:].split("/")[0])) if q.startswith("D") else Replicate() for q in layout]
        blocked = any("/" in q for q in layout)
        dt = lambda t, shape=shape, places=places, blocked=blocked: DTensor.from_local(  # noqa: E731
            t, mesh, places, run_check=False, shape=None if blocked else torch.Size(shape),
            stride=None if blocked else torch.empty(shape, device="meta").stride())
        state[f"model.{name}"] = dt(local)
        p = getattr(pm, key)
        for k, v in opt.state.get(p, {}).items():
            state[f"optim.{name}.{k}"] = dt(v) if v.dim() else v
    return state


def _rank(rank: int, world: int, port: int, args, root: str, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, checkpoint, parallelize
    from verify.models.nanogpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width)
    torch.manual_seed(0)
    x = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    pm = parallelize(GPT(cfg), (x, x), args.policy, ComputeConfig(world), gen_savedir=f"{root}/gen", verify=False)
    opt = torch.optim.AdamW(pm.parameters())
    pm(x, x).backward()
    opt.step()
    shard = (sum(t.numel() * t.element_size() for t in list(pm.parameters()) + list(pm.buffers()))
             + sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()))
    mesh = init_device_mesh("cpu", (world,))
    base = _baseline_state(pm, opt, mesh)
    times = {"save": [], "dcp_save": [], "load": [], "dcp_load": []}
    peaks = {"save": [], "dcp_save": []}
    checkpoint.save(f"{root}/warm", pm, opt)  # first calls set up DCP's machinery: not timed
    dcp.save(base, checkpoint_id=f"{root}/warm_dcp")
    for i in range(args.repeats):
        ours, theirs = f"{root}/ours{i}", f"{root}/dcp{i}"
        for kind in (("ours", "dcp") if i % 2 == 0 else ("dcp", "ours")):
            with PeakRSS() as peak:
                if kind == "ours":
                    times["save"].append(_timed(lambda: checkpoint.save(ours, pm, opt)))
                else:
                    times["dcp_save"].append(_timed(lambda: dcp.save(base, checkpoint_id=theirs)))
            peaks["save" if kind == "ours" else "dcp_save"].append(peak.added)
        for kind in (("ours", "dcp") if i % 2 == 0 else ("dcp", "ours")):
            if kind == "ours":
                times["load"].append(_timed(lambda: checkpoint.load(ours, pm, opt)))
            else:
                times["dcp_load"].append(_timed(lambda: dcp.load(base, checkpoint_id=theirs)))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ours), shutil.rmtree(theirs)
    out.put((rank, shard, times, peaks))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--policy", default="tp")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from verify.runner.gang import free_port
    # the ranks' allocator returns every large block to the system when it is freed (glibc raises its
    # mmap threshold after frees otherwise), so the resident set size follows live memory
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as root:
        mp.start_processes(_rank, args=(args.world, free_port(), args, root, out), nprocs=args.world,
                           start_method="spawn")
        results = sorted(out.get() for _ in range(args.world))
    _, _, times, _ = results[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"GPT {args.layers}x{args.width} under {args.policy} at W={args.world} (gloo, CPU), model + AdamW state, "
          f"{args.repeats} repeats, median:")
    print(f"  save: nnscaler {med['save'] * 1e3:.1f} ms, DCP directly {med['dcp_save'] * 1e3:.1f} ms, "
          f"ratio {med['save'] / med['dcp_save']:.3f} (per repeat: "
          f"{', '.join(f'{a / b:.2f}' for a, b in zip(times['save'], times['dcp_save']))})")
    print(f"  load: nnscaler {med['load'] * 1e3:.1f} ms, DCP directly {med['dcp_load'] * 1e3:.1f} ms, "
          f"ratio {med['load'] / med['dcp_load']:.3f} (per repeat: "
          f"{', '.join(f'{a / b:.2f}' for a, b in zip(times['load'], times['dcp_load']))})")
    for rank, shard, _, peaks in results:
        print(f"  rank {rank}: shard {shard / 2**20:.1f} MiB; added during save, max over repeats: nnscaler "
              f"{max(peaks['save']) / 2**20:.1f} MiB ({max(peaks['save']) / shard:.2f}x the shard), DCP directly "
              f"{max(peaks['dcp_save']) / 2**20:.1f} MiB ({max(peaks['dcp_save']) / shard:.2f}x)")


if __name__ == "__main__":
    main()
