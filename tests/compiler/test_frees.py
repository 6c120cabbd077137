"""The generated forward frees each intermediate after its last use (``nnscaler/codegen/frees.py``):
on a long chain the peak measured by torch's memory tracker falls to a few values where the same
program without its ``del`` lines holds them all, with identical numbers; a free one statement too
early (the compiler mutant ``intermediate_freed_one_step_early``) fails loudly."""
from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from nnscaler.codegen.emit import emit_program, render_program
from nnscaler.codegen.frees import free_dead
from nnscaler.compile.plan import choose_plan
from nnscaler.config import ComputeConfig
from nnscaler.trace.build import trace
from tests.mutants.catalog import applied

N = 16  # links of the chain; each value is 256 KiB


class _Chain(torch.nn.Module):
    """A long chain of operators autograd saves nothing of (adds of a scalar)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((256, 256), 0.5))

    def forward(self, x):
        x = x * self.w
        for i in range(N):
            x = x + float(i)
        return x.sum()


@pytest.fixture(scope="module")
def program():
    x = torch.randn(256, 256, requires_grad=True)
    graph = trace(_Chain(), (x,))
    return graph, render_program(emit_program(graph, choose_plan(graph, "dp", ComputeConfig(1)), 0))


def _run(src: str):
    """(peak bytes of forward + backward, loss, gradients) of ``src``'s forward, measured by MemTracker."""
    ns: dict = {}
    exec(compile(src, "generated", "exec"), ns)
    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)
    p = {"w": torch.full((256, 256), 0.5, requires_grad=True)}
    mt = MemTracker()
    with mt:
        loss = ns["forward"](p, None, x)
        loss.backward()
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], loss.detach(), x.grad, p["w"].grad


def test_the_peak_of_a_long_chain_falls_with_identical_numbers(program):
    _, src = program
    assert src.count("\n    del ") >= N
    kept = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("del ")) + "\n"
    freed, plain = _run(src), _run(kept)
    value = 256 * 256 * 4
    assert plain[0] >= N * value, plain[0]  # without frees every link of the chain is alive at once
    assert freed[0] <= 3 * value, freed[0]  # with them, a couple
    for a, b in zip(freed[1:], plain[1:]):
        assert torch.equal(a, b)


def test_a_value_freed_one_step_early_fails_loudly(program):
    graph, _ = program
    with applied("intermediate_freed_one_step_early"):
        from nnscaler.codegen import emit
        src = emit.render_program(emit.emit_program(graph, choose_plan(graph, "dp", ComputeConfig(1)), 0))
    with pytest.raises(NameError):
        _run(src)


def test_a_name_a_nested_function_reads_from_forward_is_never_freed():
    lines = ["    a = f(x)", "    def inner(b):", "        c = b + a", "        return (c,)",
             "    (d,) = checkpoint(inner, a)", "    e = d + 1", "    return e"]
    out = free_dead(lines)
    assert not any(line.strip().startswith("del") and "a" in line.strip()[4:].split(", ") for line in out), out
    assert "    del d" in out and "    del inner" in out  # the rest is freed after its last use
    assert "        del b" in out  # inside the nested function too
