"""Users' own torch parallelizations (``verify model --parallelize``): torchtitan's Llama plan, FSDP2,
FSDP2 x TP and transformers' ``tp_plan="auto"`` match one device; known-wrong plans are caught and
named by module; bad input is one line, exit 2, before any rank starts; the documented example runs."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from verify.config import RunConfig
from verify.rows.torchpar_builtin import CASES, TITAN, plan, run_builtin
from verify.cases.torchpar.mesh import parse_mesh
from verify.rows.torchpar import run_torchpar
from verify.cli import main
from verify.judge.verdict import ERROR, MATCH, MISMATCH

ROOT = Path(__file__).parents[2]
FAST = {("titan_tp", 2), ("fsdp", 2), ("fsdp_tp", 4), ("hf_llama_tp_auto", 2)}


def _row(gang, case, tmp_path):
    (row,) = run_builtin(gang, case, RunConfig(world_sizes=(2, 4)), str(tmp_path), steps=2)
    return row


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c.name}-w{c.world_size}", marks=() if
                                               (c.name, c.world_size) in FAST else pytest.mark.slow)
                                  for c in CASES if c.expect == MATCH])
def test_correct_plans_match_one_device(gang, case, tmp_path):
    row = _row(gang, case, tmp_path)
    assert row.status == MATCH, row.detail


@pytest.mark.parametrize("case", [c for c in CASES if c.expect != MATCH], ids=lambda c: c.name)
def test_known_wrong_plans_are_caught_and_localised(gang, case, tmp_path):
    """The raw verdict fails and names the module; the built-in row reads match only for that."""
    (raw,) = run_torchpar(gang, case.model, case.plan, parse_mesh(case.mesh), RunConfig(world_sizes=(2,)),
                          str(tmp_path), steps=1)
    assert raw.status == case.expect, raw.detail
    assert re.search(rf"module:? {re.escape(case.culprit)} \(", raw.detail), raw.detail
    if case.expect == MISMATCH:  # a numeric error, localised by the module hooks with its placements
        assert f"first divergent module: {case.culprit} (" in raw.detail and "tolerance" in raw.detail, raw.detail
    assert raw.rerun.startswith("python -m verify model ") and "--parallelize" in raw.rerun
    row = _row(gang, case, tmp_path)
    assert row.status == MATCH and row.detail.startswith("caught as expected"), row.detail


USER = str(Path(__file__).parents[1] / "fixtures" / "torchpar_user.py")


def test_activation_checkpointing_as_torchtitan_applies_it_verifies(gang, tmp_path):
    """``checkpoint_wrapper`` inserts ``_checkpoint_wrapped_module.`` into every name below it; the
    names are read as torch's state-dict code reads them, so the row trains, resumes and matches."""
    (row,) = run_torchpar(gang, TITAN, USER + ":fsdp_checkpointed", parse_mesh("dp"), RunConfig(world_sizes=(2,)),
                          str(tmp_path), steps=2)
    assert row.status == MATCH, row.detail


@pytest.mark.parametrize("fn,raised", [
    ("resume_raises", "RuntimeError: 'FusedQKVLinear' object has no attribute 'wq'"),
    ("resume_raises_in_dcp", "CheckpointException: on rank 0: ValueError: overlapping chunks")],  # a BaseException
    ids=["hook", "dcp"])
def test_a_resume_that_raises_keeps_the_training_checks(gang, tmp_path, fn, raised):
    """The row is an error naming the resume, and the training checks made before it stay in the row."""
    (row,) = run_torchpar(gang, TITAN, f"{USER}:{fn}", parse_mesh("dp"), RunConfig(world_sizes=(2,)),
                          str(tmp_path), steps=2)
    assert row.status == ERROR, row.detail
    assert f"the checkpoint resume raised {raised}" in row.detail, row.detail
    assert re.search(r"before it, (\d+) of \1 checks passed", row.detail), row.detail
    assert row.grad_err is not None and row.grad_err <= row.grad_tol, (row.grad_err, row.grad_tol)


def test_fsdp_as_torchtitan_ships_it_verifies_on_gloo(gang, tmp_path):
    """Gradient division disabled (a PREMUL_SUM reduce-scatter, which gloo lacks): the reductions run as
    sums with the scaling apart, each rank's loss is normalised as torchtitan's loop does, and it matches."""
    (row,) = run_torchpar(gang, TITAN, USER + ":fsdp_undivided", parse_mesh("dp"), RunConfig(world_sizes=(2,)),
                          str(tmp_path), steps=2)
    assert row.status == MATCH, row.detail
    assert "on gloo" in row.detail and "loss scaled by 1/2" in row.detail, row.detail


def test_fsdp_gradients_divided_twice_are_caught(gang, tmp_path):
    (row,) = run_torchpar(gang, TITAN, USER + ":fsdp_divided_twice", parse_mesh("dp"), RunConfig(world_sizes=(2,)),
                          str(tmp_path), steps=1, checkpoint=False)
    assert row.status == MISMATCH and "grad" in row.detail, row.detail


def test_a_plan_that_forgets_to_average_over_dp_is_caught(gang, tmp_path):
    """A plain replicated module under a ``dp`` mesh gets each rank's slice of the batch and no
    gradient averaging: its gradients are those of half the batch."""
    (row,) = run_torchpar(gang, TITAN, str(Path(__file__).parents[1] / "fixtures" / "torchpar_user.py") + ":no_sync",
                          parse_mesh("dp"), RunConfig(world_sizes=(2,)), str(tmp_path), steps=1, checkpoint=False)
    assert row.status == MISMATCH and "grad" in row.detail, row.detail
    assert "parameter gradients not reduced across ranks" in row.detail, row.detail  # no module to blame


@pytest.mark.parametrize("argv, message", [
    (["--parallelize", "{fx}:nope"], "has no function 'nope'"),
    (["--parallelize", "{fx}:returns_none"], "returned None"),
    (["--parallelize", "{fx}:returns_str"], "returned str"),
    (["--parallelize", "{fx}:renames", "--world-size", "2"], "lacks parameters"),
    (["--parallelize", "{fx}:no_sync", "--mesh", "dp=2,tp=2", "--world-size", "2"], "has 4 ranks but the world size is 2"),
    (["--parallelize", "{fx}:no_sync", "--mesh", "dp=2,tp"], "give both sizes"),
    (["--parallelize", "{fx}:no_sync", "--mesh", "dp=8", "--world-size", "8"], "does not divide over dp=8"),
    (["--mesh", "tp"], "--mesh needs --parallelize"),
    (["--parallelize", "{fx}:no_sync", "--zero", "1"], "--zero applies to the compiler's policies"),
    (["--parallelize", "/no/such.py:f"], "no such file"),
])
def test_bad_input_is_one_line_exit_2_before_ranks_start(capsys, argv, message):
    fx = str(Path(__file__).parents[1] / "fixtures" / "torchpar_user.py")
    code = main(["model", f"{fx}:build", *[a.format(fx=fx) for a in argv]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


@pytest.mark.slow  # ~30 s: a fresh interpreter and gang; the CLI's checks are fast tests above, its rows the API's
def test_readme_example_runs_from_the_cli(tmp_path):
    """The documented example (``docs/torch-parallel.md``), written out as given, verified by the command it prints."""
    text = (ROOT / "docs" / "torch-parallel.md").read_text()
    section = text.split("# Verify your own torch parallelization")[1]
    code = section.split("```python\n")[1].split("```")[0]
    (tmp_path / "my_tp.py").write_text(code)
    cmd = section.split("```bash\n")[1].splitlines()[0].split("#")[0].split()
    assert cmd[:4] == ["python", "-m", "verify", "model"]
    out = subprocess.run([sys.executable, *cmd[1:-1]], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # --world-size 2 only: one gang
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "parallelize [tp=2]" in out.stdout and "match" in out.stdout, out.stdout


def test_pytest_fixture_and_python_api_take_functions(verify_model):
    """``verify_model(build, parallelize=fn, mesh=...)``: the functions themselves, their files
    imported by the ranks."""
    from verify.models.titan_llama import titan_llama
    from verify.models.torch_plans import fsdp
    rows = verify_model(titan_llama, parallelize=fsdp, mesh="dp", world_sizes=[2], steps=1)
    assert [(r.world_size, r.partition, r.status) for r in rows] == [(2, "fsdp [dp=2]", MATCH)]


@pytest.mark.parametrize("fn, mesh, w", [("titan_tp", [["tp", 2]], 2), ("fsdp_tp", [["dp", 2], ["tp", 2]], 4)])
def test_module_localisation_names_nothing_on_a_correct_plan(gang, tmp_path, fn, mesh, w):
    """Every module's inputs, outputs and gradients, made whole from DTensors and local pieces (dp
    rows against one device on the same rows), match: the hooks raise no false culprit."""
    job = {"kind": "torchpar", "model": TITAN, "parallelize": plan(fn), "mesh": mesh, "world_size": w, "steps": 1,
           "seed": 0, "gen_dir": str(tmp_path), "checkpoint": False, "localize": True}
    answers = gang.run(job, w, 240)
    assert all("divergence_note" in a.result for a in answers), answers[0].result.get("divergence") or answers[0]
    assert "every module's outputs and input gradients match" in answers[0].result["divergence_note"]


def test_a_backward_only_fault_is_localised_in_backward(gang, tmp_path):
    """Forward exact, a needless gradient all-reduce on the logits: the backward hooks name the
    module whose output gradient is wrong when its backward starts."""
    (row,) = run_torchpar(gang, TITAN, str(Path(__file__).parents[1] / "fixtures" / "torchpar_user.py") + ":wrong_backward",
                          parse_mesh("tp"), RunConfig(world_sizes=(2,)), str(tmp_path), steps=1, checkpoint=False)
    assert row.status == MISMATCH and row.detail.startswith("grad "), row.detail  # the loss itself is right
    assert "first divergent module: model.output (Linear) [weight: S(0) on tp" in row.detail, row.detail
    assert "gradient of its output (already wrong when its backward starts" in row.detail, row.detail


@pytest.mark.parametrize("fn,raised,culprit,how", [
    ("mislaid_attention_output", "in module model.layers.0 (", "model.layers.0.attention",
     "global shape (4, 16, 64) where one device's is (4, 8, 64)"),
    ("wrong_then_backward_raises", "backward refused the gradient's shape", "model.layers.0.attention", "output error")],
    ids=["mislaid", "backward"])
def test_a_program_that_raises_names_where_it_first_parted(gang, tmp_path, fn, raised, culprit, how):
    """An exception that surfaces after the fault (a module later, or in backward): the row is the error,
    and the module where the program first parted from one device is named after it."""
    (row,) = run_torchpar(gang, TITAN, f"{USER}:{fn}", parse_mesh("tp"), RunConfig(world_sizes=(2,)), str(tmp_path),
                          steps=1)
    assert row.status == ERROR, row.detail
    assert raised in row.detail, row.detail
    assert f"before it raised, the first divergent module: {culprit} (" in row.detail, row.detail
    assert how in row.detail, row.detail


def test_a_program_that_raises_while_it_is_built_is_not_localised(gang, tmp_path, monkeypatch):
    """fn(model, mesh) raising on the ranks: the row is the error naming it, and no localiser reruns the case
    (no step ran, so no module can have parted from one device); a program raising in a step is localised."""
    from verify.rows import torchpar
    calls = []
    real = torchpar.localize_error
    monkeypatch.setattr(torchpar, "localize_error", lambda *a: calls.append(a) or real(*a))
    (row,) = run_torchpar(gang, TITAN, f"{USER}:raises_on_the_ranks", parse_mesh("tp"), RunConfig(world_sizes=(2,)),
                          str(tmp_path), steps=1)
    assert row.status == ERROR, row.detail
    assert "fn(model, mesh) on the ranks raised RuntimeError: this setup needs a backend" in row.detail, row.detail
    assert not calls
    (row,) = run_torchpar(gang, TITAN, f"{USER}:mislaid_attention_output", parse_mesh("tp"),
                          RunConfig(world_sizes=(2,)), str(tmp_path), steps=1)
    assert row.status == ERROR and len(calls) == 1, row.detail


def test_strided_shards_are_loaded_piece_by_piece(gang, tmp_path):
    """transformers' tp_plan="auto" on an MoE keeps each expert's packed gate|up as a strided shard (a rank holds
    its half of gate and its half of up): loading the reference point takes each piece where DTensor cuts it, so
    the right program matches (a block at one offset gave 'load step 0 ... differs' on every MoE of the zoo)."""
    pytest.importorskip("transformers")
    (row,) = run_torchpar(gang, "zoo:mixtral", plan("hf_tp_auto"), parse_mesh("tp"), RunConfig(world_sizes=(2,)),
                          str(tmp_path), steps=2, checkpoint=False)
    assert row.status == MATCH, row.detail
