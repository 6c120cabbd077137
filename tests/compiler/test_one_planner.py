"""One planner: ``plan_model(..., "autodist", ...)`` at cluster scale is the cluster search's plan (same
degrees, schedule, ZeRO, recompute and MFU as ``plan_cluster``), printed through ``Plan.report()``;
small models keep the per-operator search; an infeasible budget names the constraint."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from nnscaler import ComputeConfig, Plan, PlanError, plan_model
from nnscaler.cluster import plan_cluster
from nnscaler.cluster.autodist import cluster_scale, lowered
from nnscaler.compile.plan import write_report

from tests.fixtures.llama_meta import meta_llama

GiB = 2 ** 30
LLAMA3 = {"8b": (4096, 14336, 32, 32, 8), "70b": (8192, 28672, 80, 64, 8)}  # hidden, ffn, layers, heads, kv


def llama3(size: str, seq: int = 8192):
    hidden, ffn, layers, heads, kv = LLAMA3[size]
    return meta_llama(hidden, ffn, seq, 128256, layers, heads, kv)


@pytest.mark.parametrize("size,world", [("8b", 8), ("70b", 64)])
def test_autodist_at_cluster_scale_is_the_cluster_plan(size, world, tmp_path):
    pytest.importorskip("transformers")
    model, batch = llama3(size)
    config = ComputeConfig(world, profile="h100", mem_budget=80 * GiB, precision="bf16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = plan_cluster(model, batch, config)
        plan = plan_model(model, batch, "autodist", config)
    assert isinstance(plan, Plan) and plan.policy == "autodist" and plan.world_size == world
    got = plan.stats.cluster
    assert got.parallel == want.parallel  # tp, pp, dp, micro-batches, virtual stages, sp, zero, recompute
    assert got.parallel.schedule == want.parallel.schedule
    assert plan.stats.mfu == pytest.approx(want.best.mfu) and plan.stats.mfu > 0.3
    p = want.parallel
    assert plan.mesh_shape == ((p.pp, p.dp, p.cp, p.tp) if p.cp > 1 else (p.pp, p.dp, p.tp))
    summary = plan.summary()
    assert summary["mfu"] == pytest.approx(want.best.mfu) and summary["parallel"] == want.parallel.as_dict()
    assert summary["planner"] == "cluster search" and "inside a stage" in summary["inside_stage"]
    report = plan.report()
    assert f"MFU {100 * want.best.mfu:.1f}%" in report and "inside a stage" in report
    assert "calibration: " in report and "held-out error of the cost model" in report  # bounded by evidence
    assert f"MFU {100 * want.best.mfu:.1f}%" in plan.one_line()
    written = write_report(plan, tmp_path)  # the plan-report path every plan takes
    assert "MFU" in written.read_text() and json.loads((tmp_path / "plan_summary.json").read_text())["mfu"] > 0.3
    saved = json.loads(plan.stats.save(tmp_path / "plan.json").read_text())  # the file verify plan reads
    assert saved["parallel"] == want.parallel.as_dict()


def test_an_infeasible_budget_names_the_constraint_and_the_nearest_value():
    pytest.importorskip("transformers")
    model, batch = llama3("8b")
    with warnings.catch_warnings(), pytest.raises(PlanError, match=r"mem_budget=8\.0 GiB .* nearest feasible: "
                                                                    r"about \d+ ranks, or mem_budget="):
        warnings.simplefilter("ignore")
        plan_model(model, batch, "autodist", ComputeConfig(8, profile="h100", mem_budget=8 * GiB,
                                                           precision="bf16-mixed"))


def test_an_infeasible_constraint_names_the_nearest_value():
    pytest.importorskip("transformers")
    model, batch = meta_llama(256, 896, 256, 1024)
    with warnings.catch_warnings(), pytest.raises(PlanError, match="nearest feasible tp: 2 or 4"):
        warnings.simplefilter("ignore")
        plan_model(model, batch, "autodist", ComputeConfig(8, profile="h100", constraints={"tp": 3}))


def test_a_cluster_plan_lowers_to_what_parallelize_compiles():
    pytest.importorskip("transformers")
    model, batch = meta_llama(256, 896, 256, 1024)
    config = ComputeConfig(8, profile="h100", precision="bf16-mixed", global_batch=32, seed=3, clip_grad_norm=1.0,
                           constraints={"tp": 2, "pp": 2, "zero": 1, "recompute": "selective"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_model(model, batch, "autodist", config)
    policy, cfg = lowered(plan, config)
    assert policy == "hybrid" and (cfg.plan_ngpus, cfg.tp_size, cfg.pp_size) == (8, 2, 2)
    assert (cfg.zero, cfg.recompute, cfg.precision, cfg.profile, cfg.seed) == (1, "selective", "bf16-mixed", "h100", 3)
    assert cfg.clip_grad_norm == 1.0 and cfg.num_microbatches == plan.stats.cluster.parallel.num_microbatches


def test_small_models_keep_the_per_operator_search():
    """No profile, no batch, no constraints, or no stack of blocks: the per-operator integer program."""
    pytest.importorskip("transformers")
    llama, _ = meta_llama(256, 896, 256, 1024)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    assert cluster_scale(llama, ComputeConfig(2)) is False
    assert cluster_scale(mlp, ComputeConfig(2, profile="h100")) is False
    assert cluster_scale(llama, ComputeConfig(2, profile="h100")) is None  # may: when its trace reads as blocks
    assert cluster_scale(mlp, ComputeConfig(2, global_batch=4)) is True
    plan = plan_model(mlp, (torch.randn(4, 16),), "autodist", ComputeConfig(2, profile="h100"))
    assert plan.partitions and plan.stats.__class__.__name__ == "PlanStats"


def test_a_per_operator_search_that_fits_nowhere_says_how_to_reach_the_cluster_search():
    """Without a device profile the per-operator search's memory error points at the cluster search."""
    pytest.importorskip("transformers")
    import opzoo  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM
    from verify.models.common import LossOf
    m = LossOf(LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, use_cache=False)))
    ids = torch.zeros(1, 16, dtype=torch.long)
    with warnings.catch_warnings(), pytest.raises(PlanError, match="fits mem_budget.*profile='h100'.*plan_cluster"):
        warnings.simplefilter("ignore")
        plan_model(m, (ids, ids), "autodist", ComputeConfig(2, mem_budget=1024))


def _tiny_llama():
    import opzoo  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM
    from verify.models.common import LossOf
    torch.manual_seed(0)
    return LossOf(LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                               use_cache=False, attn_implementation="sdpa")))


def _parallelize_rank(rank, world, directory):
    from nnscaler import parallelize
    model = _tiny_llama()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    reference = _tiny_llama()(ids, ids).item()
    config = ComputeConfig(world, profile="h100", constraints={"tp": 2, "pp": 1, "zero": 0, "recompute": "none"})
    pm = parallelize(model, (ids, ids), "autodist", config, gen_savedir=directory, verify=False)
    return reference, pm.train_step(ids, ids).item(), type(pm).__name__, len(list(pm.parameters()))


def test_parallelize_autodist_at_cluster_scale_compiles_what_the_plan_lowers_to(tmp_path):
    """``parallelize(..., "autodist", ...)`` with constraints: the cluster plan's tp 2 program on two
    gloo ranks, the batch it is called with as the global batch; its loss is the single device's."""
    pytest.importorskip("transformers")
    from verify.runner.spawn import run_ranks
    out = run_ranks(_parallelize_rank, 2, str(tmp_path), timeout_s=240)
    for reference, loss, kind, _ in out.values():
        assert kind == "ParallelModule" and loss == pytest.approx(reference, rel=1e-4)
    assert "plan tp" in (tmp_path / "plan_report.txt").read_text()


def test_a_compile_searches_every_cp_scheme_the_compiler_lowers():
    """``parallelize``'s search admits every configuration :func:`~nnscaler.cluster.plan.cp_refusal` accepts (no
    second list of schemes): a long sequence without a named cp scheme lowers to the cost model's fastest one,
    here the ring's, not only the all-gather's; every plan it may pick lowers."""
    pytest.importorskip("transformers")
    from nnscaler.cluster.autodist import lowering
    from nnscaler.cluster.plan import cp_refusal, lowers
    from nnscaler.cluster.search import search
    from nnscaler.cluster.trace import trace_shape
    model, ids = _tiny_llama(), torch.zeros(1, 16384, dtype=torch.long)
    config = ComputeConfig(4, profile="h100", global_batch=1, constraints={"tp": 1, "pp": 1, "zero": 0})
    policy, cfg = lowering(model, (ids, ids), "autodist", config)
    assert policy == "cp_tp_ring_balanced" and (cfg.tp_size, cfg.cp_size) == (1, 4), (policy, cfg)
    best = search(trace_shape(model, (ids, ids), None), config, "llama").best.parallel  # the unfiltered search agrees
    assert lowers(best) and cp_refusal(best) is None and best.cp_scheme == "ring"


def _cp_rank(rank, world, directory, cons):
    from nnscaler import parallelize
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = _tiny_llama()(ids, ids).item()
    config = ComputeConfig(world, profile="h100", constraints=cons)
    pm = parallelize(model, (ids, ids), "autodist", config, gen_savedir=directory, verify=False)
    return reference, pm.train_step(ids, ids).item()


@pytest.mark.slow
@pytest.mark.parametrize("world,cons,policy", [
    (2, {"cp": 2, "tp": 1, "pp": 1, "zero": 0, "recompute": "none", "cp_scheme": "ulysses"}, "ulysses"),
    (2, {"cp": 2, "tp": 1, "pp": 1, "zero": 0, "recompute": "none", "cp_scheme": "ring"}, "cp_tp_ring_balanced"),
    (4, {"cp": 2, "tp": 2, "pp": 1, "zero": 0, "recompute": "none", "cp_scheme": "ulysses"}, "cp_tp_ulysses")])
def test_parallelize_autodist_compiles_a_ulysses_or_ring_plan_like_one_device(tmp_path, world, cons, policy):
    """A cp request the search lowers to Ulysses (with tp too) or to the ring compiles and its loss on gloo ranks
    is the single device's (the scheme named: at this size the cost model's own pick is the ring, whose memory
    keeps no per-layer mask bias)."""
    pytest.importorskip("transformers")
    from verify.runner.spawn import run_ranks
    out = run_ranks(_cp_rank, world, str(tmp_path), cons, timeout_s=300)
    for reference, loss in out.values():
        assert loss == pytest.approx(reference, rel=1e-4)
    assert (tmp_path / "plan_report.txt").read_text().startswith(f"plan {policy} on mesh")
