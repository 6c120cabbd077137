"""The reduce-scatter exchange (which chunk each rank sends where) is one code path for every backend:
on gloo it runs as an all-to-all, so the chunk order the nccl path relies on is exercised here. Two
real gloo ranks: equal to the chunk of the all-reduced sum, plain and in blocks, and a reversed chunk
order is caught."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verify.runner.gang import free_port


def _rank(rank: int, port: int, reverse: bool, out):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from nnscaler.runtime import collectives as C
    if reverse:  # the bug the shared path must expose: peers receive each other's chunk
        real = C.reduce_scatter_parts
        C.reduce_scatter_parts = lambda parts, group: real(parts[::-1], group)
    try:
        ok = []
        for dim, blocks in ((0, 1), (1, 1), (1, 3)):
            torch.manual_seed(rank)
            x = torch.randn(4, 12, dtype=torch.float64)
            whole = x.clone()
            dist.all_reduce(whole)
            want = C._chunk(whole, dim, dist.group.WORLD, blocks)
            got = C.reduce_scatter(x, dim, dist.group.WORLD, blocks)
            ok.append(torch.allclose(got, want, rtol=0, atol=1e-12))
        out.put((rank, ok))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reverse", [False, True])
def test_reduce_scatter_keeps_each_ranks_chunk_of_the_sum(reverse):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, reverse, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    results = [v for r in (0, 1) for v in got[r]]
    assert all(results) != reverse, got
