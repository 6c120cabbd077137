"""The model command from the command line: a user's own policy function, bad policy input, several
random seeds by default in ``verify all``, and the mutation runner on two mutants."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from verify.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
POLICY = str(ROOT / "tests" / "fixtures" / "my_policy.py")


@pytest.mark.parametrize("spec,needle", [
    ("no/such.py:fn", "is not a Python file"),
    (f"{POLICY}:missing", "has no function 'missing'"),
    (f"{POLICY}:NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
    ("sharded", "unknown policy 'sharded'"),
])
def test_a_bad_policy_exits_2_with_one_line(spec, needle, capsys):
    assert main(["model", "weightnorm_mlp", "--policy", spec, "--world-size", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_a_users_policy_function_is_verified(tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main(["model", "weightnorm_mlp", "--policy", f"{POLICY}:megatron_then_dp", f"{POLICY}:wrong_world",
                 "--world-size", "2", "--json", str(out), "--steps", "1"])
    rows = {r["partition"].rsplit(":", 1)[1]: r for r in json.loads(out.read_text())}
    assert code == 1  # the wrong policy fails its row; the right one matches
    assert rows["megatron_then_dp"]["status"] == "match", rows["megatron_then_dp"]["detail"]
    assert rows["wrong_world"]["status"] == "error" and "plan_ngpus" in rows["wrong_world"]["detail"]
    assert f"{POLICY}:wrong_world" in rows["wrong_world"]["rerun"]


def test_verify_all_runs_several_random_seeds_by_default():
    args = build_parser().parse_args(["all"])
    assert len(set(args.random_seeds)) >= 3


def test_every_built_in_policy_whose_plan_follows_the_seed_gets_every_random_seed():
    """``verify all`` runs ``--random-seeds`` for :data:`SEEDED_POLICIES`: each built-in policy
    whose plans differ across those seeds must be one of them (``random`` and ``random2d`` both)."""
    import warnings

    import opzoo  # noqa: F401
    from nnscaler.policies import POLICIES, ComputeConfig
    from nnscaler.trace.build import trace
    from verify.names import SEEDED_POLICIES
    from verify.models.loader import build_model
    case = build_model("nanogpt", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(case.model, case.batch(0))
    seeds = build_parser().parse_args(["all"]).random_seeds
    seeded = {name for name, policy in POLICIES.items() if name != "autodist"  # a search: deterministic, slow
              and len({repr(sorted(policy(graph, ComputeConfig(4, tp_size=2, seed=s)).partitions.items()))
                       for s in seeds}) > 1}
    assert seeded >= {"random", "random2d"} and seeded <= set(SEEDED_POLICIES), (seeded, SEEDED_POLICIES)


def test_the_mutation_runner_kills_one_mutant_and_not_a_harmless_one(capsys):
    from tests.mutants.run import main as run_mutants
    code = run_mutants(["--mutants", "all_reduce_missing", "loss_mean_over_local_count", "--model", "weightnorm_mlp",
                        "--op", "relu", "--no-baseline"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = {ln.split()[0]: ln.split()[1] for ln in out.splitlines() if ln.split() and ln.split()[0] in
             ("all_reduce_missing", "loss_mean_over_local_count")}
    # no cross entropy in an MSE model: that mutant changes nothing here (the full run kills it elsewhere)
    assert lines == {"all_reduce_missing": "killed", "loss_mean_over_local_count": "survived"}, out
    assert "kill rate: 1/2" in out
