"""The training recipe as one section (:class:`nnscaler.recipe.Recipe`): ``ComputeConfig``'s flat keywords
build it and read back, it crosses to the runtime whole, and the harness's run config, job entry, row
label, rerun flags and command-line flags are read off its fields."""
from __future__ import annotations

import dataclasses

import pytest

from nnscaler.config import ComputeConfig, PlanError
from nnscaler.recipe import RECIPE_FIELDS, Recipe
from verify.arguments import build_parser, recipe_dest, recipe_fields
from verify.config import RunConfig, model_label
from verify.kinds.model import Model


def test_flat_keywords_build_the_section_and_read_back():
    cfg = ComputeConfig(8, precision="bf16-mixed", zero=1, clip_grad_norm=1.0)
    assert cfg.recipe == Recipe(precision="bf16-mixed", zero=1, clip_grad_norm=1.0)
    assert (cfg.zero, cfg.precision, cfg.clip_grad_norm, cfg.num_microbatches) == (1, "bf16-mixed", 1.0, 1)
    moved = dataclasses.replace(cfg, zero=2, plan_ngpus=4)
    assert (moved.zero, moved.plan_ngpus, moved.precision) == (2, 4, "bf16-mixed")
    assert ComputeConfig(2, recipe=Recipe(zero=1), zero=2).zero == 2  # a flat keyword overrides the section's
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero = 3
    with pytest.raises(PlanError, match="zero must be 0, 1, 2 or 3"):
        ComputeConfig(2, recipe=Recipe(zero=5))


def test_the_harness_reads_everything_off_the_fields():
    cfg = RunConfig(world_sizes=(2,), microbatches=4, precision="bf16-mixed", zero=3, clip_grad_norm=1.0,
                    recompute="full")
    assert cfg.recipe.num_microbatches == cfg.microbatches == 4
    assert model_label("dp", cfg.recipe) == "dp mb4 bf16-mixed zero3 clip1 recompute=full"
    assert model_label("tp", cfg.recipe, 2) == "tp mb4 bf16-mixed zero3 x2 replicas clip1 recompute=full"
    assert model_label("tp", Recipe(), 2) == "tp x2 replicas"
    job = cfg.recipe_job(4, 256)
    assert Recipe.from_dict(job["recipe"]) == dataclasses.replace(cfg.recipe, bucket_bytes=256)
    line = Model.rerun_command(cfg, "nanogpt", "dp", 2, 0, 3)
    for flag in ("--microbatches 4", "--precision bf16-mixed", "--zero 3", "--clip-grad-norm 1.0", "--recompute full"):
        assert flag in line
    args = build_parser().parse_args(["model", "nanogpt", *line.split()[5:]])
    assert {f.name: getattr(args, recipe_dest(f)) for f in recipe_fields("model")} == \
        {f.name: getattr(cfg.recipe, f.name) for f in recipe_fields("model")}  # the rerun line parses back


def test_every_flagged_field_is_a_flag_of_verify_model():
    flagged = [f.name for f in dataclasses.fields(Recipe) if f.metadata["flag"]]
    assert [f.name for f in recipe_fields("model")] == flagged and set(flagged) <= set(RECIPE_FIELDS)
