"""Mismatching pipeline and replicas cases are localised: a wrong annotation inside a pipelined
nanoGPT is named with its stage; a pipeline whose stages all match alone, and replicas whose plan
matches alone, say where else the fault lies. ``--replicas`` keeps ``--microbatches`` and
``--bucket-bytes``, in the run and in the rerun line."""
from __future__ import annotations

import re
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

from nnscaler.policies.cut import balanced_cuts, stage_graphs
from nnscaler.compile.plan import canonical_params, plan_graph
from nnscaler.policies import ComputeConfig
from nnscaler.trace.build import trace
from tests.conftest import first_mismatch
from verify import cli
from verify.judge.verdict import MATCH, MISMATCH
from verify.config import RunConfig
from verify.rows.run import run_model
from verify.runner.gang import Gang
from verify.judge.answer import RankAnswer
from verify.localize.stages import BETWEEN_STAGES
from verify.models.registry import MODELS
from verify.rows.replicas import run_replicas

FIXTURES = Path(__file__).parents[1] / "fixtures"
WRONG_RULES = str(FIXTURES / "wrong_norm_rules.py")
MUTANTS = str(FIXTURES / "pipeline_mutants.py")
UNSYNCED = str(FIXTURES / "replicas_unsynced.py")
FORCED = str(FIXTURES / "force_localize.py")


def _row(gang, model, policy, world, modules, **cfg):
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_model(gang, model, (policy,), RunConfig(world_sizes=(world,), modules=modules, **cfg), tmp, steps=1)
    return row


def _wrong_stage_splits():
    """(seed, stage, op) for each pp2_random plan at W=4 (seeds 0..9) whose stages split a layer_norm's
    normalised dim: the first such op of the earliest such stage is the expected culprit (stage 1 first:
    it is fed the single-device activations at the cut)."""
    found = []
    for seed in range(10):
        case = MODELS["nanogpt"](seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = trace(case.model, case.batch(0))
        canonical_params(case.model, graph)
        for s, g in enumerate(stage_graphs(graph, balanced_cuts(graph, 2))):
            plan = plan_graph(g, "random", ComputeConfig(2, seed=seed, tp_size=2))
            ops = [op for op in g.ops if op.overload == "aten.layer_norm.default" and op.known
                   and plan.partition(op).factor(op.bound.inputs[0][-1][0]) > 1]
            if ops:
                found.append((seed, s, ops[0]))
                break
    return sorted(found, key=lambda f: -f[1])


@pytest.fixture(scope="module")
def wrong_rules_gang4(wrong_norm_rules):
    with Gang(4, [wrong_norm_rules], (4,)) as g:
        yield g


def test_a_wrong_annotation_inside_a_pipelined_model_is_named_with_its_stage(wrong_rules_gang4):
    cases = _wrong_stage_splits()
    assert cases
    (seed, stage, culprit), row = first_mismatch(  # a wrong split may make a later view fail outright: next seed
        cases, lambda c: _row(wrong_rules_gang4, "nanogpt", "pp2_random", 4, (WRONG_RULES,), seeds=(c[0],)))
    found = re.search(r"first divergent operator: (\S+) \(([^)]*)\) \[([^\]]*)\] in stage (\d) of 2", row.detail)
    assert found, row.detail
    assert (found.group(1), int(found.group(4))) == (culprit.name, stage), (row.detail, seed, stage, culprit)
    assert culprit.source in row.detail
    assert f"--model nanogpt --node {culprit.name} --world-size 2" in row.detail, row.detail


@pytest.fixture(scope="module")
def mutant_gang(registry):  # only the ranks import the mutants: this process keeps the right runtime
    with Gang(2, (MUTANTS, UNSYNCED), (2,)) as g:
        yield g


def test_a_pipeline_whose_stages_match_alone_says_the_fault_lies_between_them(mutant_gang):
    # the GPipe mutant scales each micro-batch's loss as the whole batch's: every stage program is right
    row = _row(mutant_gang, "nanogpt", "pp_gpipe", 2, (MUTANTS, UNSYNCED))
    assert row.status == MISMATCH and BETWEEN_STAGES in row.detail, row.detail


@pytest.fixture(scope="module")
def forced_gang(registry):  # every model case fails one extra check: correct programs get localised
    with Gang(2, (FORCED,), (2,)) as g:
        yield g


@pytest.mark.parametrize("policy", ["pp_zb", "pp"])  # two stages per rank, one stage per rank
def test_a_correct_pipeline_names_no_operator(forced_gang, policy):
    row = _row(forced_gang, "nanogpt", policy, 2, (FORCED,))
    assert row.status == MISMATCH and row.detail.endswith(BETWEEN_STAGES), row.detail


def test_replicas_whose_plan_matches_alone_blame_replica_sync_and_keep_their_options(mutant_gang):
    cfg = RunConfig(world_sizes=(2,), modules=(MUTANTS, UNSYNCED), microbatches=2)
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_replicas(mutant_gang, "nanogpt", ("dp",), cfg, tmp, 2, steps=1, bucket_bytes=256)
    assert row.status == MISMATCH and "the divergence lies in replica sync" in row.detail, row.detail
    assert row.partition == "dp mb2 x2 replicas" and row.microbatches == 2
    for flag in ("--bucket-bytes 256", "--microbatches 2", "--replicas 2", "--policy dp --world-size 2"):
        assert flag in row.rerun, row.rerun


def test_a_wrong_operator_in_a_replicated_plan_is_named_on_the_plan_ranks(gang):
    with tempfile.TemporaryDirectory() as tmp:  # tp splits the softmax's normalised dim: wrong on 2 ranks
        (row,) = run_replicas(gang, "wrong_softmax_head", ("tp",), RunConfig(world_sizes=(4,)), tmp, 2, steps=1)
    assert row.status == MISMATCH, row.detail
    assert ("first divergent operator: row_softmax (" in row.detail
            and "in the plan alone on 2 of 4 ranks" in row.detail), row.detail
    assert "alone: python -m verify op wrong_row_softmax --world-size 2 --partition b=2" in row.detail, row.detail


def test_replicas_micro_batched_with_small_buckets_train_like_one_device(gang):
    cfg = RunConfig(world_sizes=(2,), microbatches=4)
    with tempfile.TemporaryDirectory() as tmp:
        (row,) = run_replicas(gang, "bucketed_mlp", ("dp",), cfg, tmp, 2, steps=2, bucket_bytes=256)
    assert (row.status, row.detail) == (MATCH, ""), row.traceback
    assert row.partition == "dp mb4 x2 replicas"


class _Jobs:
    """A gang that records its jobs and answers with one failing check."""

    def __init__(self):
        self.jobs = []

    def run(self, job, world, limit):
        self.jobs.append(job)
        return [RankAnswer(r, {"checks": [{"name": "loss step 0", "err": 1.0, "tol": 0.0, "ok": False, "reason": "x"}]})
                for r in range(world)]


def test_verify_model_replicas_passes_microbatches_and_bucket_bytes_to_the_ranks(monkeypatch):
    seen = {}

    def fake(gang, name, policies, cfg, gen_dir, replicas, steps=3, skip=frozenset(), bucket_bytes=None):
        seen.update(microbatches=cfg.microbatches, bucket_bytes=bucket_bytes, replicas=replicas)
        return iter(run_replicas(fake_gang, name, policies, cfg, gen_dir, replicas, steps, bucket_bytes=bucket_bytes))

    @contextmanager
    def no_gang(cfg, args):
        yield None

    fake_gang = _Jobs()
    monkeypatch.setattr(cli, "run_replicas", fake)
    monkeypatch.setattr(cli, "gang_for", no_gang)
    code = cli.main(["model", "nanogpt", "--policy", "dp", "--world-size", "2", "--replicas", "2",
                     "--microbatches", "4", "--bucket-bytes", "256", "--steps", "1"])
    assert code == 1 and seen == {"microbatches": 4, "bucket_bytes": 256, "replicas": 2}
    (job,) = fake_gang.jobs
    assert (job["recipe"]["num_microbatches"], job["recipe"]["bucket_bytes"], job["plan_ngpus"]) == (4, 256, 1), job
