"""What a run is asked for (:class:`RunConfig`, passed explicitly to every stage) and bad input
(:class:`BadInput`, exit 2); one case's verdict is :class:`verify.judge.row.Row`."""
from __future__ import annotations

import math
import shlex
from pathlib import Path
from dataclasses import dataclass
from typing import Sequence

from nnscaler.ops.spec import OpSpec

from verify.models.loader import is_file_reference

MODEL_LIMIT_FACTOR = 8  # a model case traces, compiles, trains and reloads: far more than one operator


def split_base(world_sizes: Sequence[int]) -> int:
    """Every splittable length is a multiple of this, so each split degree tested divides it."""
    return math.lcm(*world_sizes) if world_sizes else 1


class BadInput(ValueError):
    """The user asked for something that does not exist (an unknown partition, say): exit code 2."""


@dataclass(frozen=True)
class RunConfig:
    """Settings of one verification run, passed explicitly to every stage."""

    world_sizes: tuple[int, ...] = (2, 4)
    dtype: str = "float32"
    seeds: tuple[int, ...] = (0,)
    modules: tuple[str, ...] = ()
    timeout_s: float = 30.0
    partition: str | None = None
    base_override: int | None = None
    microbatches: int = 1  # whole-model cases: micro-batches per training step (1: plain forward/backward)
    zero: int = 0  # whole-model cases: ZeRO stage over the data-parallel ranks (ComputeConfig(zero=))
    node: tuple[str, str] | None = None  # (model, operator): verify that traced operator (verify op --model --node)
    clip_grad_norm: float | None = None  # whole-model cases: ComputeConfig.clip_grad_norm (the reference clips too)
    recompute: str = "none"  # whole-model cases: ComputeConfig.recompute
    precision: str = "32-true"  # whole-model cases: the recipe (nnscaler.runtime.precision), judged by verify/judge/lowprec.py
    grad_reduce_dtype: str | None = None  # whole-model cases under bf16-mixed: "fp32" or "bf16"
    # whole-model cases: more ComputeConfig fields as (name, value) pairs (a cluster plan's lowering: tp_size,
    # pp_size, schedule, virtual_stages, sequence_parallel; see verify/plan/cli.py)
    layout: tuple[tuple[str, object], ...] = ()

    def recipe_job(self) -> dict:
        """The training recipe's keys of a whole-model rank job (carried into ``ComputeConfig``)."""
        return {"clip_grad_norm": self.clip_grad_norm, "recompute": self.recompute, "precision": self.precision,
                "grad_reduce_dtype": self.grad_reduce_dtype, "zero": self.zero,
                **({"layout": dict(self.layout)} if self.layout else {})}

    @property
    def recipe_label(self) -> str:
        """What a whole-model row's partition column adds for clipping and recompute (``clip1.0 recompute=full``;
        the precision is :func:`model_label`'s)."""
        parts = ([f"clip{self.clip_grad_norm:g}"] if self.clip_grad_norm is not None else []) + \
            ([f"recompute={self.recompute}"] if self.recompute != "none" else [])
        return "".join(" " + p for p in parts)

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
        ``--module`` files. A setting that decides a row is one more ``(flag, value)`` pair in
        :meth:`rerun` or :meth:`rerun_model`."""
        parts = ["python", "-m", "verify", kind] + ([] if name is None else [name])
        for flag, value in flags:
            if value is not None:
                parts += [flag, str(value)]
        for m in self.modules:
            parts += ["--module", m]
        return " ".join(shlex.quote(p) for p in parts)

    def rerun(self, op: str, world_size: int, partition: str, seed: int) -> str:
        """The command that reruns one row alone (an operator of a model: ``--model M --node N``)."""
        if self.node is not None:
            return self.command("op", None, [
                ("--model", self.node[0]), ("--node", self.node[1]), ("--world-size", world_size),
                ("--partition", partition), ("--seed", seed), ("--dtype", self.dtype)])
        return self.command("op", op, [
            ("--world-size", world_size), ("--partition", partition), ("--seed", seed), ("--dtype", self.dtype),
            ("--base", None if split_base([world_size]) == self.base else self.base)])

    def rerun_model(self, model: str, policy: str, world_size: int, seed: int, steps: int,
                    bucket_bytes: int | None = None) -> str:
        """The command that reruns one whole-model row alone (same modules, dtype, steps, buckets, micro-batches)."""
        return self.command("model", model, [
            ("--policy", policy), ("--world-size", world_size), ("--seed", seed), ("--steps", steps),
            ("--dtype", self.dtype), ("--bucket-bytes", bucket_bytes),
            ("--microbatches", self.microbatches if self.microbatches > 1 else None),
            ("--clip-grad-norm", self.clip_grad_norm), ("--recompute", None if self.recompute == "none" else self.recompute),
            ("--precision", None if self.precision == "32-true" else self.precision),
            ("--grad-reduce-dtype", self.grad_reduce_dtype), ("--zero", self.zero or None)])


def model_label(policy: str, microbatches: int = 1, precision: str = "32-true", zero: int = 0) -> str:
    """The partition column of a whole-model row: the policy, then ``mbM`` for M micro-batches, then
    the precision recipe unless ``32-true``, then ``zeroZ`` for a ZeRO stage."""
    label = policy if microbatches == 1 else f"{policy} mb{microbatches}"
    return label + (f" {precision}" if precision != "32-true" else "") + (f" zero{zero}" if zero else "")


def rerun_modules(name: str, cfg: RunConfig) -> tuple[str, ...]:
    """The ``--module`` files an operator's rerun line needs: the run's, and the model's own file when
    the model is ``FILE.py:builder`` (its operators are registered there)."""
    if is_file_reference(name):
        path = str(Path(name.rpartition(":")[0]).resolve())
        return tuple(dict.fromkeys((*cfg.modules, path)))
    return tuple(cfg.modules)
