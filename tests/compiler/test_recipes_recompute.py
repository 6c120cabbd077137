"""Activation recompute (issue 22): ``ComputeConfig(recompute=)`` wraps each block (``full``, or the
modules ``recompute_modules`` names) or each attention core (``selective``) of the generated program in
``torch.utils.checkpoint`` (non-reentrant); full recompute cuts the saved activations of a 4-layer
nanoGPT >= 3x with identical gradients; the harness matches one device under dp, tp and a pipeline;
``torch.utils.checkpoint`` inside a user's model is honoured (its regions recomputed alike; a reentrant
one refused naming ``use_reentrant=False``)."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from nnscaler.codegen.emit import emit_program, render_program
from nnscaler.compile.plan import choose_plan
from nnscaler.config import ComputeConfig
from nnscaler.trace.build import trace
from nnscaler.trace.export import TraceError
from verify.config import RunConfig
from verify.judge.verdict import MATCH
from verify.models.nanogpt import GPT, GPTConfig
from verify.runner.gang import Gang
from verify.rows.run import run_model

ROOT = Path(__file__).parents[2]


def _program(mode: str, modules=None, layers: int = 4, policy: str = "tp") -> str:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers))
    args = (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
    graph = trace(model, args)
    config = ComputeConfig(2, recompute=mode, recompute_modules=modules)
    return render_program(emit_program(graph, choose_plan(graph, policy, config), 0, recompute=mode,
                                       recompute_modules=modules))


def test_full_recomputes_each_block_and_selective_each_attention_core():
    none, full, sel = _program("none"), _program("full"), _program("selective")
    assert "checkpoint" not in none
    assert [f"# recompute (full): h.{i}" in full for i in range(4)] == [True] * 4
    assert full.count("= checkpoint(_recompute_") == 4 and "use_reentrant=False" in full
    assert sel.count("= checkpoint(_recompute_") == 4 and "# recompute (selective): h.0.attn" in sel
    core = sel.split("def _recompute_0")[1].split("= checkpoint(")[0]
    assert "scaled_dot_product_attention" in core and "aten.linear" not in core  # projections stay out
    named = _program("full", modules=("h.1", "h.3"))
    assert named.count("= checkpoint(_recompute_") == 2 and "# recompute (full): h.3" in named
    compile(full, "full", "exec"), compile(sel, "sel", "exec")


def test_full_except_core_recomputes_each_block_around_its_attention_kernel():
    """Two regions a block, before and after the attention kernel; the kernel in neither (its q, k, v and output are
    the regions' outputs and input); the projections and the MLP recomputed."""
    src = _program("full-except-core")
    assert src.count("= checkpoint(_recompute_") == 8 and src.count("# recompute (full-except-core): h.3") == 2
    regions = [body.split("= checkpoint(")[0] for body in src.split("def _recompute_")[1:]]
    assert not any("aten.scaled_dot_product_attention" in r for r in regions)
    assert "scaled_dot_product_attention" in src
    assert sum(r.count("aten.linear") for r in regions) == 4 * 4  # c_attn, c_proj, c_fc, c_proj of each block
    compile(src, "exc", "exec")


def test_a_recompute_module_that_runs_nothing_is_refused_and_no_block_warns():
    from nnscaler.codegen.recompute import RecomputeWarning
    from nnscaler.config import PlanError
    with pytest.raises(PlanError, match="recompute_modules names 'h.9'.*blocks here: h.0"):
        _program("full", modules=("h.1", "h.9"))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    graph = trace(model, (torch.randn(4, 8),))
    plan = choose_plan(graph, "dp", ComputeConfig(2, recompute="selective"))
    with pytest.warns(RecomputeWarning, match="no attention core"):
        render_program(emit_program(graph, plan, 0, recompute="selective"))


def test_full_recompute_cuts_saved_activations_3x_with_identical_gradients():
    out = subprocess.run([sys.executable, "bench/perf/recompute.py", "--json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["none"]["bytes"] >= 3 * res["full"]["bytes"], res
    assert res["full"]["grads_equal"] and res["selective"]["grads_equal"], res
    assert res["full-except-core"]["grads_equal"], res
    assert res["selective"]["bytes"] <= res["none"]["bytes"]
    assert res["full"]["bytes"] < res["full-except-core"]["bytes"] < res["none"]["bytes"] / 2, res


def test_recompute_matches_one_device_under_dp_tp_and_a_pipeline():
    with Gang(2, (), (2,)) as g, tempfile.TemporaryDirectory() as tmp:
        rows = [row for mode in ("full", "selective", "full-except-core") for p in ("dp", "tp", "pp")
                for row in run_model(g, "nanogpt", (p,), RunConfig(world_sizes=(2,), recompute=mode, clip_grad_norm=1.0),
                                     tmp, steps=2, checkpoint=False)]
    assert [r.status for r in rows] == [MATCH] * 9, [(r.partition, r.detail) for r in rows]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class _HandCheckpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.blocks, self.reentrant = nn.ModuleList(_Block() for _ in range(2)), reentrant

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return x.sum()


def test_torch_checkpoint_in_the_model_is_a_recompute_region_of_the_program():
    """It used to be traced away (the program kept every activation, silently), then refused; now each
    call's operators are a region the program runs through torch.utils.checkpoint, as the model asks."""
    graph = trace(_HandCheckpointed(False), (torch.randn(2, 8, requires_grad=True),))
    assert [op.checkpoint for op in graph.ops] == [0, 0, 1, 1, None]
    src = render_program(emit_program(graph, choose_plan(graph, "dp", ComputeConfig(2)), 0))
    assert src.count("= checkpoint(_recompute_") == 2 and "# recompute (the model): torch.utils.checkpoint #1" in src
    assert "sum.default" not in src.split("= checkpoint(_recompute_1")[0].split("def _recompute_1")[1]
    compile(src, "hand", "exec")


def test_a_reentrant_torch_checkpoint_is_refused_naming_use_reentrant_false():
    with pytest.raises(TraceError) as info:
        trace(_HandCheckpointed(True), (torch.randn(2, 8, requires_grad=True),))
    msg = str(info.value)
    assert "\n" not in msg and "use_reentrant=False" in msg and "test_recipes_recompute.py" in msg, msg
    import torch.utils.checkpoint as tuc  # the watch is undone
    assert tuc.CheckpointFunction.__name__ == "CheckpointFunction"


def test_a_model_that_checkpoints_itself_matches_one_device_and_saves_what_it_saves():
    """Checked against one device under dp and tp (W=2); the measured saved activations of the
    checkpointing model are a fraction of the same model's without (as on one device)."""
    fixture = str(ROOT / "tests" / "fixtures" / "hand_checkpoint_models.py")
    from verify.runner.worker import load_modules
    load_modules([fixture])
    names = ("hand_checkpoint_none", "hand_checkpoint_non_reentrant")
    with Gang(2, (fixture,), (2,)) as g, tempfile.TemporaryDirectory() as tmp:
        rows = {(n, p): row for n in names for p in ("dp", "tp")
                for row in run_model(g, n, (p,), RunConfig(world_sizes=(2,), modules=(fixture,)), tmp, steps=2,
                                     checkpoint=False)}
    assert all(r.status == MATCH for r in rows.values()), [(k, r.detail) for k, r in rows.items() if r.status != MATCH]
    saved = {k: max(m["activations"] for m in r.memory) for k, r in rows.items()}
    for p in ("dp", "tp"):
        for n in names[1:]:
            assert 2 * saved[(n, p)] <= saved[(names[0], p)], saved


@pytest.mark.slow
def test_recipes_match_on_llama_and_at_w4():
    """Slow (minutes): llama under dp, tp, hybrid and pp at W=2, nanogpt under hybrid and pp2_tp at W=4,
    each with full recompute and clipping."""
    cases = [("llama", p, 2) for p in ("dp", "tp", "hybrid", "pp")] + [("nanogpt", p, 4) for p in ("hybrid", "pp2_tp")]
    with Gang(4, (), (2, 4)) as g, tempfile.TemporaryDirectory() as tmp:
        rows = [row for name, p, w in cases
                for row in run_model(g, name, (p,), RunConfig(world_sizes=(w,), recompute="full", clip_grad_norm=1.0),
                                     tmp, steps=2, checkpoint=False)]
    assert [r.status for r in rows] == [MATCH] * len(cases), [(r.partition, r.detail) for r in rows]
