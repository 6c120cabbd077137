"""What a run is asked for (:class:`RunConfig`, passed explicitly to every stage; the one assembler of
rerun lines, :meth:`RunConfig.command`, which each case kind fills) and bad input (:class:`BadInput`,
exit 2); one case's verdict is :class:`verify.judge.row.Row`."""
from __future__ import annotations

import math
import shlex
from pathlib import Path
from dataclasses import dataclass, replace
from typing import Sequence

from nnscaler.ops.spec import OpSpec
from nnscaler.recipe import Recipe, with_recipe

from verify.models.loader import is_file_reference

RECIPE = Recipe(precision="bf16-mixed", zero=3, recompute="full", clip_grad_norm=1.0)
"""``verify all``'s sample recipe: its recipe units train under it (``verify/sweep/selection.py``)."""
MODEL_LIMIT_FACTOR = 8  # a model case traces, compiles, trains and reloads: far more than one operator


def split_base(world_sizes: Sequence[int]) -> int:
    """Every splittable length is a multiple of this, so each split degree tested divides it."""
    return math.lcm(*world_sizes) if world_sizes else 1


class BadInput(ValueError):
    """The user asked for something that does not exist (an unknown partition, say): exit code 2."""


@with_recipe(aliases={"microbatches": "num_microbatches"})
@dataclass(frozen=True)
class RunConfig:
    """Settings of one verification run, passed explicitly to every stage. ``recipe``: the training
    recipe of its whole-model cases (:class:`nnscaler.recipe.Recipe`, the compiler's own, run alike
    by the single-device reference); its fields are also taken as flat keywords and read back as
    properties (``microbatches`` for ``num_microbatches``)."""

    world_sizes: tuple[int, ...] = (2, 4)
    dtype: str = "float32"
    seeds: tuple[int, ...] = (0,)
    modules: tuple[str, ...] = ()
    timeout_s: float = 30.0
    partition: str | None = None
    base_override: int | None = None
    node: tuple[str, str] | None = None  # (model, operator): verify that traced operator (verify op --model --node)
    # whole-model cases: more ComputeConfig fields as (name, value) pairs (a cluster plan's lowering: tp_size,
    # pp_size, schedule, virtual_stages, sequence_parallel; see verify/plan/cli.py)
    layout: tuple[tuple[str, object], ...] = ()
    recipe: Recipe = Recipe()

    def recipe_job(self, microbatches: int, bucket_bytes: int | None = None) -> dict:
        """The recipe's entry of a whole-model rank job, with this case's micro-batches and buckets
        (``bucket_bytes`` None: the recipe's), and the lowered plan's ``layout`` if any."""
        recipe = replace(self.recipe, num_microbatches=microbatches,
                         bucket_bytes=self.recipe.bucket_bytes if bucket_bytes is None else bucket_bytes)
        return {"recipe": recipe.to_dict(), **({"layout": dict(self.layout)} if self.layout else {})}

    def limit_s(self, kind: str = "op", steps: int = 1) -> float:
        """The time limit of one case: ``timeout_s`` for an operator case; a model case traces,
        compiles, trains ``steps`` steps on three copies and reloads its checkpoint twice, so it gets
        ``MODEL_LIMIT_FACTOR`` times that, growing with the steps beyond three and with the
        micro-batches beyond two (each step then runs that many forward and backward passes)."""
        if kind == "model":
            return self.timeout_s * MODEL_LIMIT_FACTOR * max(1.0, steps / 3) * max(1.0, self.microbatches / 2)
        return self.timeout_s

    @property
    def base(self) -> int:
        """Splittable lengths are multiples of this (the lcm of the world sizes unless overridden)."""
        return self.base_override or split_base(self.world_sizes)

    def job(self, spec: OpSpec) -> dict:
        """What names the operator in a rank job: a registered name, or a model's traced node."""
        if self.node is None:
            return {"op": spec.name}
        return {"op": self.node[1], "model": self.node[0]}

    def row_name(self, spec: OpSpec) -> str:
        """The op column of a row: the registered name, or ``MODEL:NODE``."""
        return spec.name if self.node is None else f"{self.node[0]}:{self.node[1]}"

    def command(self, kind: str, name: str | None, flags: Sequence[tuple[str, object]]) -> str:
        """The one place a rerun command is assembled: ``python -m verify KIND NAME`` (no ``NAME`` when
        ``None``) with ``flags`` in order (a ``None`` value leaves its flag out), then this run's
        ``--module`` files. A setting that decides a row is one more ``(flag, value)`` pair in its case
        kind's ``rerun_command`` (``verify/kinds/``)."""
        parts = ["python", "-m", "verify", kind] + ([] if name is None else [name])
        for flag, value in flags:
            if value is not None:
                parts += [flag, str(value)]
        for m in self.modules:
            parts += ["--module", m]
        return " ".join(shlex.quote(p) for p in parts)


def model_label(policy: str, recipe: Recipe = Recipe(), replicas: int = 1) -> str:
    """The partition column of a whole-model row: the policy, then each labelled recipe field off its
    default in field order (``mbM`` for M micro-batches, the precision, ``zeroZ``, ...), ``xR replicas``
    before the first field labelled after the replicas (clipping, recompute)."""
    label, tagged = policy, replicas == 1
    for word, after_replicas in recipe.label_words():
        if after_replicas and not tagged:
            label, tagged = label + f" x{replicas} replicas", True
        label += " " + word
    return label if tagged else label + f" x{replicas} replicas"


def recipe_tag(recipe: Recipe) -> str:
    """The recipe's part of a generated-program directory's name (``-mb4-bf16-mixed-zero3-clip1-recomputefull``)."""
    return model_label("", recipe).replace(" ", "-").replace("=", "")


def rerun_modules(name: str, cfg: RunConfig) -> tuple[str, ...]:
    """The ``--module`` files an operator's rerun line needs: the run's, and the model's own file when
    the model is ``FILE.py:builder`` (its operators are registered there)."""
    if is_file_reference(name):
        path = str(Path(name.rpartition(":")[0]).resolve())
        return tuple(dict.fromkeys((*cfg.modules, path)))
    return tuple(cfg.modules)
