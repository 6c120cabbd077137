"""The built-in torch-parallelization cases of ``verify all`` (their own section, rows
``torchpar:NAME``): torchtitan's Llama plan, FSDP2 with and without tensor parallelism, transformers'
``tp_plan="auto"``, and known-wrong plans that must be caught and localised to their module.

A known-wrong case's row reads ``match`` when the harness caught it as expected (its status and the
module it names), its detail quoting the harness's own verdict; ``MISMATCH`` when it was missed."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

from verify.config import RunConfig

from verify.judge.row import Row
from verify.cases.torchpar.mesh import parse_mesh
from verify.rows.torchpar import run_torchpar
from verify.judge.verdict import ERROR, MATCH, MISMATCH
from verify.runner.gang import Gang

MODELS = Path(__file__).resolve().parent.parent / "models"
TITAN, TITAN96 = f"{MODELS / 'titan_llama.py'}:titan_llama", f"{MODELS / 'titan_llama.py'}:titan_llama_v96"
HF_LLAMA, HF_QWEN3 = f"{MODELS / 'hf_tp.py'}:llama", f"{MODELS / 'hf_tp.py'}:qwen3"


def plan(name: str) -> str:
    return f"{MODELS / 'torch_plans.py'}:{name}"


@dataclass(frozen=True)
class TorchCase:
    """One built-in case: ``plan`` applied to ``model`` on a ``mesh`` of ``world_size`` ranks, and what
    the harness must say (``expect``; for a known-wrong plan, the module it must name)."""

    name: str
    model: str
    plan: str
    mesh: str
    world_size: int
    expect: str = MATCH
    culprit: str = ""


CASES = (
    TorchCase("titan_tp", TITAN, plan("titan_tp"), "tp", 2),
    TorchCase("titan_tp", TITAN, plan("titan_tp"), "tp", 4),
    TorchCase("titan_tp_replicated_logits", TITAN, plan("titan_tp_replicated_logits"), "tp", 2),
    TorchCase("titan_tp_wo_colwise", TITAN, plan("titan_tp_wo_colwise"), "tp", 2),
    TorchCase("fsdp", TITAN, plan("fsdp"), "dp", 2),
    TorchCase("fsdp", TITAN, plan("fsdp"), "dp", 4),
    TorchCase("fsdp_tp", TITAN, plan("fsdp_tp"), "dp=2,tp=2", 4),
    TorchCase("hf_llama_tp_auto", HF_LLAMA, plan("hf_tp_auto"), "tp", 2),
    TorchCase("hf_llama_tp_auto", HF_LLAMA, plan("hf_tp_auto"), "tp", 4),
    TorchCase("hf_qwen3_tp_auto", HF_QWEN3, plan("hf_tp_auto"), "tp", 2),
    TorchCase("hf_qwen3_tp_auto", HF_QWEN3, plan("hf_tp_auto"), "tp", 4),
    TorchCase("vocab_offsets_v96", TITAN96, plan("wrong_vocab_offsets"), "tp", 2),  # right where tp divides
    TorchCase("wrong_rowwise_as_colwise", TITAN, plan("wrong_rowwise_as_colwise"), "tp", 2, ERROR,
              "model.layers.0.attention.wo"),
    TorchCase("wrong_missing_sp_gather", TITAN, plan("wrong_missing_sp_gather"), "tp", 2, MISMATCH,
              "model.layers.0.attention"),
    TorchCase("wrong_vocab_offsets", TITAN, plan("wrong_vocab_offsets"), "tp", 2, MISMATCH, "loss"),
)


def label(case: TorchCase) -> str:
    return f"{case.plan.rpartition(':')[2]} [{case.mesh}]" + (" known-wrong" if case.expect != MATCH else "")


def caught(case: TorchCase, row: Row) -> bool:
    """A known-wrong case's row says what it must: its status, and its culprit module by name."""
    named = f"module {case.culprit} (" in row.detail or f"module: {case.culprit} (" in row.detail
    return row.status == case.expect and named


def run_builtin(gang: Gang, case: TorchCase, cfg: RunConfig, gen_dir: str, steps: int = 3,
                skip: frozenset | set = frozenset()) -> Iterator[Row]:
    """The row of one built-in case (none where its world size is not in ``cfg``)."""
    if case.world_size not in cfg.world_sizes:
        return
    name = f"torchpar:{case.name}"
    if (name, case.world_size, label(case), cfg.dtype, cfg.seeds[0]) in skip:
        return
    one = replace(cfg, world_sizes=(case.world_size,), seeds=cfg.seeds[:1])
    for row in run_torchpar(gang, case.model, case.plan, parse_mesh(case.mesh), one, gen_dir, steps, label=label(case)):
        row = replace(row, op=name)
        if case.expect == MATCH:
            yield row
        elif caught(case, row):
            yield replace(row, status=MATCH, annotation=f"known-wrong: must be {case.expect} at {case.culprit}",
                          detail=f"caught as expected: {row.status}: {row.detail}")
        else:
            yield replace(row, status=MISMATCH, annotation=f"known-wrong: must be {case.expect} at {case.culprit}",
                          detail=f"known-wrong plan not caught as expected ({case.expect} naming {case.culprit}): "
                                 f"{row.status}: {row.detail}")
