"""Pipeline stages without ranks: the cut (every operator in one stage, each stage's inputs are the
previous stage's outputs, tied parameters in every stage using them), the balancing program against
brute force, and bad input refused with one line before any rank starts."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nnscaler import ComputeConfig, PlanError
from nnscaler.policies.cut import check_model, cut_units
from nnscaler.policies.cut import balanced_cuts, best_cuts, candidates, split_at_modules, stage_graphs, stage_costs
from nnscaler.compile.plan import canonical_params
from nnscaler.trace.build import trace
from verify.cli import main
from verify.models.loader import build_model


@pytest.fixture(scope="module")
def nanogpt():
    case = build_model("nanogpt", 0)
    args = tuple(a[:1] for a in case.batch(0))
    graph = trace(case.model, args)
    canonical_params(case.model, graph)
    return case.model, graph


@pytest.mark.parametrize("n", [2, 3, 4])
def test_stages_chain_and_cover_every_operator(nanogpt, n):
    model, graph = nanogpt
    stages = stage_graphs(graph, balanced_cuts(graph, n))
    assert len(stages) == n
    assert [op.name for g in stages for op in g.ops] == [op.name for op in graph.ops]
    assert [t.name for t in stages[0].inputs] == [t.name for t in graph.inputs]
    for a, b in zip(stages, stages[1:]):  # what one stage sends is exactly what the next receives
        assert [(t.name, t.shape, t.dtype) for t in a.outputs] == [(t.name, t.shape, t.dtype) for t in b.inputs]
    assert [t.name for t in stages[-1].outputs] == [t.name for t in graph.outputs]
    for g in stages:  # every tensor an operator reads is made in the stage or received
        known = set(g.inputs) | set(g.params) | set(g.buffers)
        for op in g.ops:
            assert all(t in known for t in op.tensor_inputs()), op.name
            known.update(t for t in op.outputs if t is not None)
    # the targets reach the last stage (the loss is computed there)
    assert "targets" in [t.name for t in stages[-1].inputs] or any("target" in t.name for t in stages[-1].inputs)


def test_a_tied_embedding_lives_in_the_first_and_last_stage():
    case = build_model("gpt2", 0)  # GPT-2's lm_head is its token embedding
    graph = trace(case.model, tuple(a[:1] for a in case.batch(0)))
    canonical_params(case.model, graph)
    stages = stage_graphs(graph, balanced_cuts(graph, 2))
    holders = [i for i, g in enumerate(stages) if "model.transformer.wte.weight" in {t.target for t in g.params}]
    assert holders == [0, 1]


def test_split_points_by_module_name(nanogpt):
    model, graph = nanogpt
    (cut,) = split_at_modules(graph, model, ("h.1",))
    first = stage_graphs(graph, [cut])[1].ops[0]
    assert any(t.target.startswith("h.1.") for t in first.tensor_inputs())
    with pytest.raises(PlanError, match="order"):
        split_at_modules(graph, model, ("h.1", "h.0"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000).map(float), st.sampled_from([0.0, 4.0, 8.0])), min_size=3, max_size=9),
       st.integers(2, 4), st.data())
def test_balancing_finds_the_brute_force_optimum(costs, n, data):
    time, pbytes = [c[0] for c in costs], [c[1] for c in costs]
    cands = sorted(data.draw(st.sets(st.integers(1, len(costs) - 1), min_size=1)))
    if n - 1 > len(cands):
        with pytest.raises(PlanError, match="layers"):
            best_cuts(time, pbytes, cands, n)
        return

    def worst(cuts):
        b = [0, *cuts, len(time)]
        return max((sum(time[i:j]), sum(pbytes[i:j])) for i, j in zip(b, b[1:]))

    got = best_cuts(time, pbytes, cands, n)
    assert len(got) == n - 1 and got == sorted(got) and set(got) <= set(cands)
    assert worst(got) == min(worst(c) for c in itertools.combinations(cands, n - 1))


def test_balanced_stages_are_closer_than_an_even_split_of_operators(nanogpt):
    _, graph = nanogpt
    time, _ = stage_costs(graph)
    cands = candidates(graph)
    cuts = balanced_cuts(graph, 2)
    b = [0, *cuts, len(time)]
    heaviest = max(sum(time[i:j]) for i, j in zip(b, b[1:]))
    assert all(heaviest <= max(sum(time[:c]), sum(time[c:])) for c in cands)


# -- bad input: one line each, before any rank --------------------------------------------------------
@pytest.mark.parametrize("kwargs,needle", [
    (dict(plan_ngpus=4, pp_size=3), "pp_size 3 does not divide the world size 4"),
    (dict(plan_ngpus=2, pp_size=2, schedule="Zigzag"), "unknown pipeline schedule 'Zigzag'; valid: GPipe, 1F1B"),
    (dict(plan_ngpus=2, pp_size=0), "pp_size must be a positive integer"),
    (dict(plan_ngpus=4, pp_size=2, pp_split=("a", "b")), "2 stages need 1 split points"),
])
def test_bad_pipeline_configs_are_refused(kwargs, needle):
    with pytest.raises(PlanError, match=needle.replace("(", r"\(")):
        ComputeConfig(**kwargs)


def test_a_schedule_name_is_case_insensitive():
    assert ComputeConfig(2, pp_size=2, schedule="gpipe").schedule == "gpipe"


@pytest.mark.parametrize("cfg,args,needle", [
    (dict(plan_ngpus=4, pp_size=4), "batch", None),
    (dict(plan_ngpus=2, pp_size=2, pp_split=("h.9",)), "batch", "split point 'h.9' is not a module.*did you mean h.1"),
    (dict(plan_ngpus=2, pp_size=2), "odd", "has 3 rows \\(dim 0\\), not divisible by num_microbatches=4"),
    (dict(plan_ngpus=3, pp_size=3, pp_split=("h.1", "h.0")), "batch", "not in program order \\('h.0' runs before"),
    (dict(plan_ngpus=3, pp_size=3, pp_split=("ln_f", "h.1")), "batch", "not in program order"),
    (dict(plan_ngpus=3, pp_size=3, pp_split=("h.1", "h.1")), "batch", "are the same module"),
    (dict(plan_ngpus=3, pp_size=3, pp_split=("h", "h.1")), "batch", "'h' and 'h.1' nest"),
    (dict(plan_ngpus=3, pp_size=3, pp_split=("h.1", "ln_f")), "batch", None),
])
def test_model_checks(cfg, args, needle):
    case = build_model("nanogpt", 0)
    batch = case.batch(0) if args == "batch" else tuple(a[:3] for a in case.batch(0))
    if needle is None:
        check_model(case.model, batch, ComputeConfig(**cfg, num_microbatches=4))
    else:
        with pytest.raises(PlanError, match=needle):
            check_model(case.model, batch, ComputeConfig(**cfg, num_microbatches=4))


class _DefinedBackwards(torch.nn.Module):
    """Defines its head, then its body, but runs the body first (as many models define modules)."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 1)
        self.norm = torch.nn.BatchNorm1d(4)
        self.body = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, y):
        for layer in self.body:
            x = self.drop(torch.relu(layer(x)))
        return ((self.head(self.norm(x)) - y) ** 2).mean()


def test_split_points_are_ordered_as_the_model_runs_them_not_as_it_defines_them():
    """Split points in run order pass though the model defines them the other way round; in reverse
    they are refused naming the one that runs first; the check's forward leaves the batch norm's
    running statistics and the random state as they were."""
    torch.manual_seed(0)
    model, batch = _DefinedBackwards(), (torch.randn(8, 4), torch.randn(8, 1))
    stats, rng = {k: b.clone() for k, b in model.named_buffers()}, torch.get_rng_state()
    check_model(model, batch, ComputeConfig(3, pp_size=3, pp_split=("body.1", "head"), num_microbatches=4))
    assert all(torch.equal(stats[k], b) for k, b in model.named_buffers()) and torch.equal(rng, torch.get_rng_state())
    with pytest.raises(PlanError, match=r"not in program order \('body.1' runs before 'head'"):
        check_model(model, batch, ComputeConfig(3, pp_size=3, pp_split=("head", "body.1"), num_microbatches=4))
    with pytest.raises(PlanError, match="_DefinedBackwards fails on the sample arguments"):
        check_model(model, (torch.randn(8, 5), torch.randn(8, 1)),
                    ComputeConfig(3, pp_size=3, pp_split=("body.1", "head"), num_microbatches=4))


def test_more_stages_than_layers_is_refused():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    assert cut_units(mlp) == ["0", "2"]
    with pytest.raises(PlanError, match="split point '1' holds no parameters"):
        check_model(mlp, (torch.randn(4, 4),), ComputeConfig(2, pp_size=2, pp_split=("1",)))
    with pytest.raises(PlanError, match="3 pipeline stages but Sequential has only 2 layers"):
        check_model(mlp, (torch.randn(4, 4),), ComputeConfig(3, pp_size=3))


def test_the_cli_refuses_a_bad_pipeline_before_any_rank_starts(tmp_path, capsys):
    f = tmp_path / "tiny.py"
    f.write_text("import torch\n"
                 "class M(torch.nn.Module):\n"
                 "    def __init__(self):\n        super().__init__(); self.l = torch.nn.Linear(4, 1)\n"
                 "    def forward(self, x, y):\n        return ((self.l(x) - y) ** 2).mean()\n"
                 "def build(seed):\n    torch.manual_seed(seed)\n"
                 "    return M(), lambda step: (torch.randn(8, 4), torch.randn(8, 1))\n")
    assert main(["model", f"{f}:build", "--policy", "pp", "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 pipeline stages but M has only 1 layers" in err[0], err
    assert main(["model", "nanogpt", "--policy", "pp2_tp", "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pp2_tp runs at none of the world sizes [2]" in err[0], err
    assert main(["model", "nanogpt", "--policy", "pp2_tp", "--replicas", "2", "--world-size", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # replicas: the pipeline is planned on W / R = 2 ranks
    assert len(err) == 1 and "runs at none of the world sizes [4] with 2 replicas" in err[0], err


def test_random_stage_plans_are_swept_at_every_random_seed():
    """``verify all`` draws random plans on pipeline meshes too (issue 13): a pipeline policy whose
    stages are planned by a seeded policy is swept, once per ``--random-seeds``."""
    from nnscaler.policies.pipeline import PIPELINE_POLICIES, SWEPT
    from verify.names import SEEDED_POLICIES
    seeded = {n for n, p in PIPELINE_POLICIES.items() if p.stage_policy in ("random", "random2d")}
    assert seeded and seeded <= set(SWEPT) and seeded <= set(SEEDED_POLICIES)


def test_a_checkpoint_is_reloaded_at_a_world_size_the_gang_has_groups_for():
    """At W=3 (``verify model nanogpt --policy pp --world-size 3``) the gang has no group of 2 ranks:
    the reload runs at W=3 (it used to ask for ranks (0, 1) and fail the row)."""
    from verify.cases.resume import pipeline_plan_b, plan_b
    assert [pipeline_plan_b("pp", w) for w in (2, 3, 4, 6, 8)] == [("pp_interleaved", 2), ("pp", 3), ("pp2_tp", 4),
                                                                   ("pp_interleaved", 2), ("pp2_tp", 4)]
    assert pipeline_plan_b("pp2_tp", 8) == ("pp_interleaved", 2) and pipeline_plan_b("pp_interleaved", 2) == ("pp", 2)
    assert plan_b("tp", 3) == ("random", 3) and plan_b("dp", 5)[1] == 5


def test_interleaved_schedules_are_swept_and_skipped_where_the_model_has_too_few_layers():
    """``verify all`` sweeps pp_interleaved and pp_zb (2 stages per rank); a world size whose stages
    outnumber the model's layers is skipped (no row), as a world size a policy does not apply to."""
    from nnscaler.policies.pipeline import SWEPT
    from verify.cases.pipeline import check_pipeline_input, pipeline_applies
    assert {"pp_interleaved", "pp_zb"} <= set(SWEPT)
    assert len(cut_units(build_model("transformer_encoder", 0).model)) == 12  # 16 stages at W=8 do not fit
    assert pipeline_applies("pp_zb", 4, "transformer_encoder")
    assert not pipeline_applies("pp_zb", 8, "transformer_encoder")
    assert pipeline_applies("pp_zb", 8) and not pipeline_applies("pp2_tp", 2, "nanogpt")
    check_pipeline_input("transformer_encoder", ["pp_zb"], (4, 8))  # W=8 skipped, W=4 runs: no error
    with pytest.raises(PlanError, match="16 pipeline stages but"):
        check_pipeline_input("transformer_encoder", ["pp_zb"], (8,))


def test_hybrid_stages_at_eight_ranks_are_dp_by_tp_meshes():
    """``pp2_hybrid`` at W=8 is pp2 x dp2 x tp2: each stage a (2, 2) mesh whose operators split on
    both axes (the batch on dp, Megatron's dims on tp)."""
    import opzoo  # noqa: F401
    from nnscaler.policies.pipeline import pipeline_config, stage_config
    from nnscaler.compile.plan import plan_graph
    case = build_model("nanogpt", 0)
    policy, cfg = pipeline_config("pp2_hybrid", ComputeConfig(8, num_microbatches=4, tp_size=2))
    graph = trace(case.model, case.batch(0))
    canonical_params(case.model, graph)
    for g in stage_graphs(graph, balanced_cuts(graph, cfg.pp_size)):
        plan = plan_graph(g, policy, stage_config(cfg))
        assert plan.mesh_shape == (2, 2) and plan.axis_names == ("dp", "tp")
        assert any(plan.partition(op).label.count("=2") == 2 for op in g.ops)
