"""An operator's kinds: ``op_partitions`` (the partitions of a registered operator or a traced model's
node, per world size) and ``op`` (one partition on these ranks against one device; in the sweep, a
registered operator under every partition, world size and seed, labelled by its name)."""
from __future__ import annotations

from dataclasses import dataclass

from nnscaler.runtime.mesh import RankMesh

from verify.cases import op as rank_case
from verify.cases.node import node_sample
from verify.cases.samples import DTYPES, Sample, make_sample
from verify.config import RunConfig, split_base
from verify.kinds.registry import CaseKind, case_kind


def sample_of(state, job: dict) -> tuple[Sample, rank_case.Reference]:
    """The sample and reference of an operator job, kept on the rank across its partitions (one at a time)."""
    key = (job["op"], job.get("model"), job["dtype"], job["seed"], job["base"])
    kept = state.kept.get("op_sample")
    if kept is None or kept[0] != key:
        if job.get("model"):  # an operator of a traced model, at its traced lengths
            sample = node_sample(job["model"], job["op"], job["dtype"], job["seed"])
        else:
            sample = make_sample(state.registry.get(job["op"]), DTYPES[job["dtype"]], job["seed"], job["base"])
        kept = state.kept["op_sample"] = (key, sample, rank_case.reference(sample, state.device))
    return kept[1], kept[2]


@case_kind("op_partitions")
@dataclass(frozen=True)
class OpPartitions(CaseKind):
    """The partitions to run per world size (keys: op, model, dtype, seed, base, world_sizes, partition)."""

    def run(self, state) -> dict:
        job = self.job
        sample, _ = sample_of(state, job)
        plans = {w: [p.label for p in rank_case.partitions_of(sample, w, job.get("partition"))]
                 for w in job["world_sizes"]}
        return {"plans": plans, "annotation": sample.spec.annotation, "sizes": dict(sample.bound.sizes)}


@case_kind("op")
@dataclass(frozen=True)
class Op(CaseKind):
    """One partition of an operator on these ranks (keys: op, model, dtype, seed, base, world_size, partition)."""

    def run(self, state) -> dict:
        job = self.job
        sample, ref = sample_of(state, job)
        partition = rank_case.partitions_of(sample, job["world_size"], job["partition"])[0]
        if ref.random:
            return {"unverifiable": ref.random}
        mesh = RankMesh.build(partition.mesh_shape, state.rank, state.groups)
        checks = rank_case.run_case(sample, ref, partition, mesh, state.device)
        return {"checks": [c.__dict__ for c in checks]}

    @classmethod
    def label(cls, unit) -> str:
        return unit.name

    @classmethod
    def rerun_command(cls, cfg: RunConfig, op: str, world_size: int, partition: str, seed: int) -> str:
        """The command that reruns one operator row alone (an operator of a model: ``--model M --node N``)."""
        if cfg.node is not None:
            return cfg.command("op", None, [
                ("--model", cfg.node[0]), ("--node", cfg.node[1]), ("--world-size", world_size),
                ("--partition", partition), ("--seed", seed), ("--dtype", cfg.dtype)])
        return cfg.command("op", op, [
            ("--world-size", world_size), ("--partition", partition), ("--seed", seed), ("--dtype", cfg.dtype),
            ("--base", None if split_base([world_size]) == cfg.base else cfg.base)])
