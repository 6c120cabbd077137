"""ZeRO 2/3 releases each gradient bucket once its reduce-scatter is done (``nnscaler/runtime/zero.py``,
``IN_FLIGHT``): through a backward over eight buckets at most one packed bucket is alive, and the peak
measured by torch's memory tracker is lower than when every bucket waits for the end of backward
(the former behaviour, ``IN_FLIGHT`` unbounded). One rank of four on a fake process group."""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from nnscaler import ComputeConfig
from nnscaler.runtime import zero as zero_mod

WIDTH, BLOCKS = 128, 8
BUCKET = WIDTH * (WIDTH + 1) * 4  # one block's weight and bias: one bucket each


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.h = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))

    def forward(self, x):
        for lin in self.h:
            x = torch.relu(lin(x))
        return x.sum()


def _backward(stage: int):
    """(buckets, most packed buckets alive at once, peak bytes) of one backward of rank 0 of 4."""
    import opzoo  # noqa: F401
    from nnscaler.compile.parallelize import parallelize
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        torch.manual_seed(0)
        x = torch.randn(4, WIDTH)
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = parallelize(_Stack(), (x,), "dp", ComputeConfig(1, runtime_ngpus=4, zero=stage, bucket_bytes=BUCKET),
                             gen_savedir=d, verify=False)
            z = pm._zero
            tracker = MemTracker()
            with tracker:
                pm(x[:1]).backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        return len([b for b in z.buckets if b.scatter]), z.most_pending, peak
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [2, 3])
def test_the_packed_gradient_buckets_alive_stay_bounded_through_backward(stage, monkeypatch):
    buckets, most, peak = _backward(stage)
    assert buckets == BLOCKS and most <= zero_mod.IN_FLIGHT == 1, (buckets, most)
    monkeypatch.setattr(zero_mod, "IN_FLIGHT", 10 ** 6)  # every bucket kept until the end of backward
    _, most_piled, piled = _backward(stage)
    assert most_piled == BLOCKS
    assert piled - peak >= BLOCKS // 2 * BUCKET, (peak, piled)  # half the buckets and more (zero 3 peaks mid-way)
