"""The training recipe, as one frozen section of :class:`nnscaler.config.ComputeConfig`: how each step
trains (micro-batches, precision, ZeRO, clipping, recompute, gradient-sync buckets), handed whole from
the compiler to the runtime module and carried whole by the harness (its run config, jobs, labels,
rerun lines, verdict-cache key and ``verify model`` / ``verify all`` flags are all read off the fields).

A field's metadata is what the harness needs to speak of it: ``help`` and ``flag`` (the command-line
option, its value of the field's type; ``commands`` the ``verify`` commands offering it, ``help_all``
its help under ``verify all``, ``metavar``, ``choices``, ``positive``: refused unless above 0),
``label`` (its word in a whole-model row's partition column when not the default; ``after_replicas``:
after a replicas row's ``xR replicas``, where clipping and recompute have always stood). This module
imports nothing of the compiler, so no torch (``python -m verify --help`` reads the fields); a recipe
is checked (:meth:`Recipe.check`) where a :class:`~nnscaler.config.ComputeConfig` is made.

A new recipe option is a field here (with its check in :meth:`Recipe.check`; the flag, label, rerun flag
and cache key follow from it), its implementation (for a step on the gradients after backward, as
clipping is: one ``@grad_step`` function in ``nnscaler/runtime/grad_steps.py``) and its single-device
reference (the harness's ``verify/cases/recipe_steps.py``, one ``@reference_step`` function)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields


RECOMPUTE = ("none", "selective", "full", "full-except-core")  # nnscaler.codegen.recompute
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")  # PyTorch Lightning's names (nnscaler.runtime.precision)


class RecipeError(ValueError):
    """A recipe the compiler cannot run (:class:`~nnscaler.config.ComputeConfig` raises it as ``PlanError``)."""


def _option(default, help: str, flag: str | None = None, commands: tuple[str, ...] = ("model",), **meta):
    """A recipe field: its default and what the harness says of it (see the module's docstring)."""
    return field(default=default, metadata={"help": help, "flag": flag, "commands": commands if flag else (), **meta})


@dataclass(frozen=True)
class Recipe:
    """How each training step runs. ``num_microbatches``: ``train_step`` splits each batch into this
    many micro-batches along dim 0 and accumulates their gradients (one gradient sync, after the
    last); ``parallelize`` then takes a sample of the whole batch and compiles for one micro-batch.
    ``precision``: ``"32-true"`` (default), ``"bf16-mixed"`` (bf16 compute as under ``torch.autocast``,
    fp32 master weights, gradients and optimizer state; gradients reduced in ``grad_reduce_dtype``,
    ``"fp32"`` unless ``"bf16"``) or ``"bf16-true"`` (see :mod:`nnscaler.runtime.precision`).
    ``zero``: ZeRO over the plan's data-parallel ranks (its ``dp`` mesh axis and replicas,
    :mod:`nnscaler.runtime.zero`): 0 off, 1 optimizer state sharded, 2 gradients too
    (reduce-scattered), 3 parameters too (gathered per block). ``clip_grad_norm``: a max norm
    ``train_step`` clips the whole model's gradient norm to (:mod:`nnscaler.runtime.clip`).
    ``recompute`` (:mod:`nnscaler.codegen.recompute`): "none", "full" (each block), "selective" (the
    attention core) or "full-except-core" (each block but its attention core) on torch.utils.checkpoint;
    ``recompute_modules`` names the blocks "full" recomputes.
    ``bucket_bytes``: the size of gradient-sync buckets (None: ``nnscaler.runtime.grad_sync.BUCKET_BYTES``).

    The fields' order is the order of a row's label and of a rerun line's flags."""

    num_microbatches: int = _option(
        1, "train each step by train_step in M micro-batches (M of the model's batches stacked), against one "
           "device on the whole batch (default 1: plain forward and backward)",
        flag="--microbatches", metavar="M", positive=True, label="mb{}")
    precision: str = _option(
        "32-true", "whole models: 32-true (default), bf16-mixed (bf16 compute as under torch.autocast, fp32 master "
                   "weights) or bf16-true, each against the single-device run of the same recipe (bound: "
                   "verify/judge/compare.py)",
        flag="--precision", commands=("model", "all"), metavar="RECIPE", label="{}")
    zero: int = _option(
        0, "ZeRO stage over the data-parallel ranks (dp, hybrid's dp axis, --replicas): 1 shards optimizer state, "
           "2 also gradients (default 0)",
        flag="--zero", commands=("model", "all"), metavar="Z", label="zero{}",
        help_all="train the models under ZeRO stage Z where a plan has data-parallel ranks (dp, hybrid at W>=4, "
                 "the tp replicas rows); the other model rows are left out (default 0)")
    clip_grad_norm: float | None = _option(
        None, "clip the whole model's gradient norm to MAX each step (ComputeConfig.clip_grad_norm; the reference "
              "uses torch.nn.utils.clip_grad_norm_)",
        flag="--clip-grad-norm", commands=("model", "all"), metavar="MAX", label="clip{:g}",
        after_replicas=True)
    recompute: str = _option(
        "none", "activation recompute: none (default), full (each block), selective (attention core), "
                "full-except-core (each block but its attention core)",
        flag="--recompute", commands=("model", "all"), metavar="MODE", label="recompute={}",
        after_replicas=True)
    grad_reduce_dtype: str | None = _option(
        None, "with --precision bf16-mixed: the dtype gradients are reduced in (default fp32)",
        flag="--grad-reduce-dtype", choices=("fp32", "bf16"))
    bucket_bytes: int | None = _option(
        None, "gradient-sync bucket size of the compiled module (default: the model's, else 4 MiB)",
        flag="--bucket-bytes", metavar="N", positive=True)
    recompute_modules: tuple[str, ...] | None = _option(None, "the blocks recompute='full' recomputes (module names)")

    def check(self) -> None:
        """Each field's check: ``clip_grad_norm`` a positive finite number (or None); ``recompute`` one of
        :data:`RECOMPUTE`; ``recompute_modules`` a tuple of module names, with ``recompute="full"``;
        ``precision`` one of :data:`PRECISIONS`; ``grad_reduce_dtype`` one of its flag's choices, only with
        ``bf16-mixed``; micro-batches, buckets, the ZeRO stage. Raises :class:`RecipeError`. (Whether
        this device has bf16 is :class:`~nnscaler.config.ComputeConfig`'s check.)"""
        reduce_dtypes = _field("grad_reduce_dtype").metadata["choices"]
        clip = self.clip_grad_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0
                                 or clip == float("inf")):
            raise RecipeError(f"clip_grad_norm must be a positive finite max norm (or None for no clipping), "
                              f"got {clip!r}")
        if self.recompute not in RECOMPUTE:
            raise RecipeError(f"unknown recompute {self.recompute!r}; valid: {', '.join(map(repr, RECOMPUTE))}")
        mods = self.recompute_modules
        if mods is not None:
            if isinstance(mods, str) or not all(isinstance(m, str) and m for m in mods):
                raise RecipeError(f"recompute_modules must be a tuple of module names (e.g. ('layers.0',)), "
                                  f"got {mods!r}")
            if self.recompute != "full":
                raise RecipeError(f"recompute_modules names the blocks recompute='full' recomputes, but recompute "
                                  f"is {self.recompute!r}")
        if self.precision not in PRECISIONS:
            raise RecipeError(f"unknown precision {self.precision!r}; valid: {', '.join(map(repr, PRECISIONS))} "
                              f"(PyTorch Lightning's names)")
        if self.grad_reduce_dtype is not None:
            if self.grad_reduce_dtype not in reduce_dtypes:
                raise RecipeError(f"unknown grad_reduce_dtype {self.grad_reduce_dtype!r}; valid: "
                                  f"{', '.join(map(repr, reduce_dtypes))}")
            if self.precision != "bf16-mixed" and self.grad_reduce_dtype != "fp32":
                raise RecipeError(f"grad_reduce_dtype={self.grad_reduce_dtype!r} needs precision='bf16-mixed' "
                                  f"(got precision={self.precision!r})")
        m = self.num_microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise RecipeError(f"num_microbatches must be a positive integer, got {m!r}")
        if self.bucket_bytes is not None and self.bucket_bytes < 1:
            raise RecipeError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise RecipeError(f"zero must be 0, 1, 2 or 3 (the ZeRO stage), got {self.zero!r}")

    def label_words(self) -> list[tuple[str, bool]]:
        """Each labelled field off its default, in field order: its word in a whole-model row's partition
        column (``mb4``, ``bf16-mixed``, ``zero3``, ``clip1``, ``recompute=full``) and whether it stands
        after a replicas row's ``xR replicas``."""
        return [(f.metadata["label"].format(getattr(self, f.name)), bool(f.metadata.get("after_replicas")))
                for f in fields(self) if "label" in f.metadata and getattr(self, f.name) != f.default]

    @property
    def label(self) -> str:
        """The words of :meth:`label_words`, each with a space before it (`` bf16-mixed zero3 clip1 ...``)."""
        return "".join(" " + word for word, _ in self.label_words())

    def flags(self) -> list[tuple[str, object]]:
        """The rerun line's ``(flag, value)`` pairs: each flagged field off its default (else ``None``,
        which leaves the flag out)."""
        return [(f.metadata["flag"], None if getattr(self, f.name) == f.default else getattr(self, f.name))
                for f in fields(self) if f.metadata["flag"]]

    def to_dict(self) -> dict:
        """The recipe as a rank job carries it (:meth:`from_dict` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Recipe":
        """A recipe from :meth:`to_dict`'s form (lists back to tuples; ``None``: the defaults)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in (d or {}).items()})


RECIPE_FIELDS = tuple(f.name for f in fields(Recipe))


def _field(name: str):
    return next(f for f in fields(Recipe) if f.name == name)


def with_recipe(cls=None, *, aliases: dict[str, str] | None = None):
    """Class decorator for a frozen dataclass with a ``recipe: Recipe`` field: its constructor also
    takes each recipe field as a flat keyword (overriding ``recipe``'s; ``aliases`` maps other
    keywords to fields), and each reads back as a read-only property, so
    ``ComputeConfig(8, precision="bf16-mixed", zero=1).zero == 1`` and ``dataclasses.replace(config,
    zero=2)`` work as before the section existed."""
    names = {**{n: n for n in RECIPE_FIELDS}, **(aliases or {})}

    def wrap(cls):
        init = cls.__init__

        def __init__(self, *args, **kwargs):
            flat = {names[k]: kwargs.pop(k) for k in list(kwargs) if k in names}
            if flat:
                kwargs["recipe"] = dataclasses.replace(kwargs.get("recipe") or Recipe(), **flat)
            init(self, *args, **kwargs)

        __init__.__doc__, __init__.__wrapped__ = init.__doc__, init
        cls.__init__ = __init__
        for key, name in names.items():
            if not hasattr(cls, key):
                setattr(cls, key, property(lambda self, n=name: getattr(self.recipe, n),
                                           doc=f"``recipe.{name}`` (read-only)"))
        return cls
    return wrap if cls is None else wrap(cls)
