"""Cluster plans as files and as programs: ``plan.save`` / ``nnscaler.cluster.plan.load``, the one lowering to what the
compiler runs (checked against the splits the cost model costed), the reduction ``verify plan`` makes, bad
plan files refused in one line, and on real ranks a reduced plan that trains like one device while a
known-wrong runtime under the same plan is caught."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from nnscaler import PlanError
from nnscaler.cluster.cost import Parallel
from nnscaler.cluster.plan import check_lowering, load, lower
from verify.cli import main

from tests.fixtures.llama_meta import saved_plan

pytest.importorskip("transformers")
FIXTURES = Path(__file__).parents[1] / "fixtures"


def test_lowering_is_megatrons_order_and_the_plans_recipes():
    par = Parallel(tp=2, pp=2, dp=4, micro_batch_size=1, num_microbatches=4, virtual_stages=2,
                   sequence_parallel=True, zero=1, recompute="full")
    policy, cfg = lower(par, "bf16-mixed")
    assert policy == "hybrid" and cfg.plan_ngpus == 16 and cfg.tp_size == 2 and cfg.pp_size == 2
    assert (cfg.schedule, cfg.virtual_stages, cfg.num_microbatches) == ("Interleaved1F1B", 2, 4)
    assert (cfg.sequence_parallel, cfg.zero, cfg.recompute, cfg.precision) == (True, 1, "full", "bf16-mixed")
    assert lower(Parallel(tp=4))[0] == "tp" and lower(Parallel(dp=4, zero=2))[0] == "dp"
    assert lower(Parallel(tp=2, zero=1))[1].zero == 0  # no dp ranks: nothing to shard


def test_saved_plan_reads_back_and_reduces(tmp_path):
    from verify.models.saved_plan import reduce
    plan, path = saved_plan(tmp_path, 32, {"tp": 4, "pp": 4, "dp": 2, "virtual_stages": 2, "sequence_parallel": True,
                                      "recompute": "selective", "zero": 1, "micro_batch_size": 1})
    saved = load(path)
    assert saved.parallel == plan.parallel and saved.world == 32 and saved.architecture["transformers"] == \
        "LlamaForCausalLM"
    data = json.loads(path.read_text())
    assert data["lowered"]["policy"] == "hybrid" and data["lowered"]["config"]["virtual_stages"] == 2
    red = reduce(saved)
    p = red["parallel"]
    assert (p["tp"], p["pp"], p["dp"], p["virtual_stages"]) == (2, 2, 2, 2)  # every axis kept, each of 2
    assert (p["sequence_parallel"], p["recompute"], p["zero"], p["schedule"]) == (True, "selective", 1,
                                                                                   "Interleaved1F1B")
    assert p["num_microbatches"] % p["pp"] == 0
    cfg = red["architecture"]["config"]
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] == 4  # the planned model's ratio
    assert cfg["num_key_value_heads"] % 2 == 0 and cfg["num_hidden_layers"] == 4 and cfg["vocab_size"] % 2 == 0


def test_the_compiler_splits_what_the_cost_model_costed(tmp_path):
    import opzoo  # noqa: F401
    from verify.models.hf import llama
    from verify.models.saved_plan import build_case, write_reduced
    _, path = saved_plan(tmp_path, 8, {"tp": 2, "pp": 2, "dp": 2})
    case = build_case(str(write_reduced(load(path), tmp_path)), 0)
    assert check_lowering(case.model, case.batch(0), Parallel(tp=2, dp=2)) == []
    assert check_lowering(case.model, case.batch(0), Parallel(tp=2, sequence_parallel=True)) == []
    wrong = check_lowering(case.model, case.batch(0), Parallel(tp=2), policy="random")
    assert wrong and all("planned" in w for w in wrong)
    # the harness's own tiny Llama (a vocabulary of 101, prime): its embedding stays whole, so the cost
    # model's Megatron costing does not describe it, and the check says where
    odd = llama(0, 32)
    found = check_lowering(odd.model, odd.batch(0), Parallel(tp=2, dp=2))
    assert any("embed_tokens) costed vocabulary-parallel" in w for w in found), found
    assert not any("q_proj" in w for w in found), found  # hybrid's tp axis splits attention by heads, as tp does


def test_hybrid_splits_one_head_per_rank_by_heads(tmp_path):
    """A multi-head (kv = heads) plan reduced to 2 heads on tp 2 (Llama-2-13B's saved plans): the
    greedy alone keeps the attention whole under ``hybrid``; the head pins ``tp`` uses carry to
    hybrid's tp axis, so the projections are split as costed."""
    import opzoo  # noqa: F401
    from verify.models.saved_plan import build_case, write_reduced
    _, path = saved_plan(tmp_path, 8, {"tp": 2, "pp": 1, "dp": 4})
    data = json.loads(path.read_text())
    cfg = data["architecture"]["config"]
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]  # multi-head: reduced to max(tp, 2) = 2 heads
    path.write_text(json.dumps(data))
    red = write_reduced(load(path), tmp_path)
    assert json.loads(red.read_text())["architecture"]["config"]["num_attention_heads"] == 2
    case = build_case(str(red), 0)
    assert check_lowering(case.model, case.batch(0), Parallel(tp=2, dp=2)) == []
    assert check_lowering(case.model, case.batch(0), Parallel(tp=2, dp=2, sequence_parallel=True)) == []


def test_bad_plan_files_are_one_line_and_exit_2(tmp_path, capsys):
    _, good = saved_plan(tmp_path, 8, {"tp": 2, "pp": 2})
    data = json.loads(good.read_text())
    cases = {
        "missing.json": None,
        "text.json": "not json",
        "world.json": {**data, "world_size": 16},
        "arch.json": {**data, "architecture": None},
        "tp.json": {**data, "parallel": {**data["parallel"], "tp": 0}},
        "format.json": {**data, "format": "other/9"},
    }
    words = {"missing.json": "no such file", "text.json": "not JSON", "world.json": "world_size 16 is not tp x cp x pp x dp",
             "arch.json": "no architecture", "tp.json": "parallel.tp=0", "format.json": "format 'other/9'"}
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
        assert main(["plan", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words[name] in err[0], (name, err)
    assert main(["plan", str(good), "--as-planned", "--module", str(tmp_path / "none.py")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_ulysses_plan_under_tp_lowers_and_a_scheme_the_compiler_lacks_is_refused_by_name(tmp_path, capsys,
                                                                                            monkeypatch):
    plan, path = saved_plan(tmp_path, 16, {"tp": 2, "cp": 4, "pp": 2, "cp_scheme": "ulysses"})
    data = json.loads(path.read_text())
    assert (data["parallel"]["cp"], data["parallel"]["cp_scheme"], data["world_size"]) == (4, "ulysses", 16)
    assert data["lowered"]["policy"] == "cp_tp_ulysses" and load(path).parallel == plan.parallel
    assert data["lowered"]["config"]["tp_size"] == 2 and data["lowered"]["config"]["cp_size"] == 4
    # the refusal stays wired for a scheme the compiler would lack (none today: CP_MISSING is empty)
    import nnscaler.cluster.plan as cluster_plan
    monkeypatch.setitem(cluster_plan.CP_MISSING, "ulysses", "Ulysses's all-to-all")
    with pytest.raises(PlanError, match=r"cp=4, ulysses, balanced\) .*missing Ulysses's all-to-all"):
        lower(plan.parallel)
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "context parallelism (cp=4, ulysses, balanced)" in err[0], err
    # a file written before cp reads as cp 1
    old = {**data, "world_size": 4, "parallel": {k: v for k, v in data["parallel"].items() if not k.startswith("cp")}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load(tmp_path / "old.json").parallel.cp == 1


def test_an_allgather_cp_plan_lowers_to_cp_tp_in_megatrons_order(tmp_path):
    par = Parallel(tp=2, cp=4, pp=2, dp=2, num_microbatches=2, zero=1, recompute="full", cp_balanced=False)
    policy, cfg = lower(par, "bf16-mixed")
    assert policy == "cp_tp" and (cfg.plan_ngpus, cfg.tp_size, cfg.cp_size, cfg.pp_size, cfg.zero) == (32, 2, 4, 2, 1)
    from nnscaler.policies.cp_mesh import cp_tp_mesh
    from nnscaler.policies.pipeline import stage_config
    assert cp_tp_mesh(stage_config(cfg)) == ((2, 4, 2), ("dp", "cp", "tp"))  # tp innermost, then cp, then dp
    assert cp_tp_mesh(stage_config(lower(Parallel(cp=2, cp_balanced=False))[1])) == ((2,), ("cp",))
    plan, path = saved_plan(tmp_path, 8, {"tp": 2, "cp": 2, "pp": 2, "cp_scheme": "allgather", "cp_balanced": False})
    data = json.loads(path.read_text())
    assert data["lowered"]["policy"] == "cp_tp" and data["lowered"]["config"]["cp_size"] == 2
    # causally balanced chunks lower to cp_tp_balanced (pipeline stages included), Ulysses without tp to ulysses,
    # with tp to cp_tp_ulysses (dp x tp x cp: cp innermost, each tp rank's heads cut on cp)
    assert lower(Parallel(tp=2, cp=4, pp=2, cp_balanced=True))[0] == "cp_tp_balanced"
    policy, cfg = lower(Parallel(cp=4, pp=2, dp=2, num_microbatches=2, zero=3, cp_scheme="ulysses"))
    assert policy == "ulysses" and (cfg.plan_ngpus, cfg.tp_size, cfg.cp_size, cfg.pp_size) == (16, 1, 4, 2)
    policy, cfg = lower(Parallel(tp=2, cp=4, pp=2, dp=2, num_microbatches=2, zero=1, cp_scheme="ulysses"))
    from nnscaler.policies.cp_mesh import ulysses_tp_mesh
    assert policy == "cp_tp_ulysses" and ulysses_tp_mesh(stage_config(cfg)) == ((2, 2, 4), ("dp", "tp", "cp"))
    # the ring scheme lowers to cp_tp_ring, balanced chunks or not (nnscaler/policies/ring.py)
    assert lower(Parallel(tp=2, cp=4, pp=2, cp_scheme="ring", cp_balanced=True))[0] == "cp_tp_ring_balanced"
    assert lower(Parallel(cp=4, dp=2, cp_scheme="ring", cp_balanced=False))[0] == "cp_tp_ring"
    assert "cp_size" not in json.loads(saved_plan(tmp_path, 4, {"tp": 2, "cp": 1}, "nocp.json")[1].read_text()
                                       )["lowered"]["config"]  # plans without cp save as before


def test_a_cp_plan_with_tp_is_compiled_as_costed_and_one_with_sp_refused(tmp_path):
    """tp2 x cp: the cp axis holds the sequence, and tp's options never split a weight by it: the MLP stays
    column-then-row as costed (with sp offered, a norm's weight split by hidden made gate_proj row-parallel); with
    sp over contiguous chunks likewise; a plan with sp under balanced chunks is refused by name (it once lowered
    to a program without sp, and verified)."""
    from verify.plan.cli import prepare
    cons = {"tp": 2, "cp": 4, "pp": 1, "cp_scheme": "allgather", "cp_balanced": False}
    _, path = saved_plan(tmp_path, 8, cons)
    case = prepare(path, tmp_path)
    assert case.policy == "cp_tp" and not case.reduced.parallel.sequence_parallel
    assert case.problems == (), case.problems
    (tmp_path / "sp").mkdir()
    _, path = saved_plan(tmp_path / "sp", 8, {**cons, "cp_balanced": True, "sequence_parallel": True})
    with pytest.raises(Exception, match="sequence parallelism under context parallelism .* has no compiler lowering"):
        prepare(path, tmp_path / "sp")
    (tmp_path / "contiguous").mkdir()
    _, path = saved_plan(tmp_path / "contiguous", 8, {**cons, "sequence_parallel": True})
    case = prepare(path, tmp_path / "contiguous")
    assert case.policy == "cp_tp" and case.reduced.parallel.sequence_parallel and case.problems == (), case.problems


def test_a_reduced_cp_plan_with_sequence_parallelism_trains_like_one_device(tmp_path, capsys):
    # 8 GPUs: tp 2 +sp x cp 4, contiguous chunks -> tp2+sp cp2 at W=4: norms split on cp and again on tp
    _, path = saved_plan(tmp_path, 8, {"tp": 2, "cp": 4, "pp": 1, "cp_scheme": "allgather", "cp_balanced": False,
                                       "sequence_parallel": True})
    assert main(["plan", str(path), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp2+sp cp2-allgather pp1 dp1" in out and "1 match" in out, out[-2000:]


@pytest.mark.slow
def test_a_reduced_cp_plan_keeps_its_axis_and_trains_like_one_device(tmp_path, capsys):
    # 8 GPUs: tp 2 x cp 4, all-gather, contiguous chunks -> tp2 cp2 at W=4, cp_tp's (cp, tp) mesh
    _, path = saved_plan(tmp_path, 8, {"tp": 2, "cp": 4, "pp": 1, "cp_scheme": "allgather", "cp_balanced": False})
    assert main(["plan", str(path), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "cp2-allgather pp1 dp1" in out and "1 match" in out, out[-2000:]  # the cp axis kept, of 2


@pytest.mark.slow
@pytest.mark.parametrize("cons, label, policy", [
    # 8 GPUs: cp 4 in Llama 3's balanced chunks x dp 2, ZeRO-3 -> cp2 dp2 at W=4 under cp_tp_balanced
    ({"tp": 1, "cp": 4, "pp": 1, "cp_scheme": "allgather", "cp_balanced": True, "zero": 3},
     "tp1 cp2-allgather-balanced pp1 dp2", "cp_tp_balanced in each of 1 stage"),
    # 8 GPUs: Ulysses cp 4 x dp 2, ZeRO-1 -> cp2 dp2 at W=4 under ulysses (dp x cp)
    ({"tp": 1, "cp": 4, "pp": 1, "cp_scheme": "ulysses", "zero": 1}, "tp1 cp2-ulysses pp1 dp2", "ulysses in each of 1"),
    # 8 GPUs: Ulysses under tp, tp 2 x cp 4 -> tp2 cp2 at W=4 under cp_tp_ulysses (dp x tp x cp)
    ({"tp": 2, "cp": 4, "pp": 1, "cp_scheme": "ulysses", "sequence_parallel": False}, "tp2 cp2-ulysses pp1 dp1",
     "cp_tp_ulysses in each of 1"),
])
def test_a_reduced_balanced_or_ulysses_plan_keeps_its_scheme_and_trains_like_one_device(tmp_path, capsys, cons, label,
                                                                                          policy):
    _, path = saved_plan(tmp_path, 8, cons)
    assert main(["plan", str(path), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert label in out and policy in out and "1 match" in out, out[-2000:]


@pytest.mark.slow
def test_a_reduced_plan_trains_like_one_device_and_a_wrong_runtime_is_caught(tmp_path, capsys):
    # 8 GPUs: tp 2 with sequence parallelism x 4 interleaved stages, selective recompute -> tp2 pp2 v2 at W=4
    _, path = saved_plan(tmp_path, 8, {"tp": 2, "pp": 4, "virtual_stages": 2, "sequence_parallel": True,
                                  "recompute": "selective"})
    assert main(["plan", str(path), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp2+sp pp2 v2 dp1" in out and "1 match" in out
    # the same plan under a runtime whose last micro-batch carries no gradient: a mismatch, with its rerun line
    _, path = saved_plan(tmp_path, 4, {"tp": 1, "pp": 2, "dp": 2, "zero": 1}, "pp2.json")
    assert main(["plan", str(path), "--steps", "1", "--precision", "32-true", "--module",
                 str(FIXTURES / "microbatch_mutant.py")]) == 1
    out = capsys.readouterr().out
    assert "mismatch" in out and f"python -m verify plan {path}" in out
