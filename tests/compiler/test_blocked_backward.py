"""Blocked layouts' backward on two real gloo ranks: a dim fused of hidden factors (``(h d)``, split in
blocks) gathered, split or gathered-with-summed-gradient passes each rank the gradient of ITS blocks; a
backward that scatters plain chunks instead is wrong only where blocks > 1, which the random plans and
the conversion tests did not reach (issue 40: the all-gather whose gradient is summed)."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.distributed as dist

from nnscaler.runtime import collectives as C
from verify.runner.gang import free_port

W, BLOCKS = 2, 2


def _piece(x: torch.Tensor, r: int) -> torch.Tensor:
    """Rank ``r``'s blocked piece of ``x`` along dim 0 (its chunk of each of BLOCKS blocks)."""
    return x.unflatten(0, (BLOCKS, -1)).chunk(W, dim=1)[r].flatten(0, 1)


def _rank(rank: int, port: int, which: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
    try:
        g = torch.Generator().manual_seed(0)
        whole = torch.randn(8, 3, generator=g, dtype=torch.float64)
        cot = [torch.randn(8, 3, generator=g, dtype=torch.float64) for _ in range(W)]  # each rank's own cotangent
        group = dist.group.WORLD
        if which == "split":
            x = whole.clone().requires_grad_()
            (C.split(x, 0, group, BLOCKS) * _piece(cot[0], rank)).sum().backward()
            want = cot[0]  # every rank's piece of the cotangent, gathered back into place
        else:
            x = _piece(whole, rank).clone().requires_grad_()
            gather = C.all_gather_sum_grad if which == "sum_grad" else C.all_gather
            y = gather(x, 0, group, BLOCKS)
            assert torch.equal(y, whole)
            if which == "sum_grad":  # the gathered tensor feeds work split along this axis: gradients are partial
                (y * cot[rank]).sum().backward()
                want = _piece(cot[0] + cot[1], rank)
            else:  # replicated work: every rank holds the same (whole) gradient
                (y * cot[0]).sum().backward()
                want = _piece(cot[0], rank)
        out.put((rank, bool(torch.allclose(x.grad, want)), float((x.grad - want).abs().max())))
    except Exception as exc:  # noqa: BLE001 (reported to the parent)
        out.put((rank, False, repr(exc)))
    finally:
        dist.destroy_process_group()


def _run(which: str) -> list:
    ctx = mp.get_context("fork")  # the ranks carry this process's code as it is (a harness mutant applied here too)
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, which, out), daemon=True) for r in range(W)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return sorted(got)


def test_a_blocked_gather_whose_gradient_is_summed_scatters_by_blocks():
    got = _run("sum_grad")
    assert all(ok for _, ok, _ in got), got


@pytest.mark.parametrize("which", ["gather", "split"])
def test_a_blocked_gather_and_split_pass_gradients_back_by_blocks(which):
    got = _run(which)
    assert all(ok for _, ok, _ in got), got
