"""A cluster plan as the compiler runs it and as a file.

:func:`lower` is the one place an outer configuration (:class:`~nnscaler.cluster.cost.Parallel`) becomes
what the compiler runs: a policy name and a :class:`~nnscaler.config.ComputeConfig` (``tp`` inside a
stage by Megatron-LM's rule, ``hybrid`` = dp x tp, ``dp``; pipeline stages, schedule, micro-batches,
ZeRO, recompute, sequence parallelism, precision). The cost model's block facts assume exactly that
per-operator plan, so the per-operator :class:`~nnscaler.ir.plan.Plan` is derived from the cluster
plan, never chosen apart from it: ``plan_graph(graph, *lower(parallel, ...))``.

The file (:meth:`ClusterPlan.save <nnscaler.cluster.search.ClusterPlan.save>`, read back by
:func:`load`) is JSON, no pickle: the summary (``parallel``, estimates), :data:`FORMAT`, the
``architecture`` (a ``transformers`` model's class and config, enough to rebuild the model at another
size) and ``lowered`` (the policy and config fields :func:`lower` gives). A plan with context
parallelism (``cp`` > 1) saves with its ``cp``, ``cp_scheme`` and ``cp_balanced`` in ``parallel``; it
lowers to ``cp_tp`` (dp x cp x tp inside a stage, :mod:`nnscaler.policies.cp_mesh`), ``cp_tp_balanced``
(:mod:`nnscaler.policies.context`), ``ulysses`` / ``cp_tp_ulysses`` (Ulysses without / with tp), or for the ring
scheme ``cp_tp_ring`` / ``cp_tp_ring_balanced`` (:mod:`nnscaler.policies.ring`) where the compiler has its scheme
(:func:`cp_refusal`: every scheme today); otherwise ``lowered``
is null and :func:`lower` refuses it naming what is missing, so nothing runs such a plan without its cp
axis or scheme. Files without the cp fields (written before cp) read as ``cp`` 1.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import CONSTRAINT_KEYS, CP_SCHEMES, RECOMPUTE_CHOICES, ComputeConfig, PlanError
from .cost import Parallel
from ..runtime.precision import PRECISIONS

FORMAT = "nnscaler-cluster-plan/1"
LOWERED_FIELDS = ("plan_ngpus", "tp_size", "pp_size", "schedule", "virtual_stages", "sequence_parallel",
                  "num_microbatches", "recompute", "zero", "precision")


# what the compiler lacks for each cp plan it does not lower, by key (none today: cp_tp / cp_tp_balanced: all-gather
# of keys and values, contiguous or balanced chunks; cp_tp_ring / cp_tp_ring_balanced: the ring exchange, either chunk
# layout; ulysses (dp x cp) and cp_tp_ulysses (dp x tp x cp): all-to-all of q, k, v and the output)
CP_MISSING: dict[str, str] = {}


def cp_refusal(par: Parallel) -> str | None:
    """Why ``par``'s context parallelism has no compiler lowering (one line naming what is missing), or
    ``None`` when it lowers (``cp`` 1, the all-gather scheme over contiguous or balanced chunks, the ring
    scheme over either, Ulysses with or without tp: every scheme of :data:`~nnscaler.config.CP_SCHEMES` today;
    a scheme named in :data:`CP_MISSING` would be refused; sequence parallelism on tp only over contiguous
    chunks, nested inside each cp chunk)."""
    if par.cp == 1:
        return None
    if par.sequence_parallel and par.tp > 1 and (par.cp_balanced or par.cp_scheme == "ulysses"):
        return (f"sequence parallelism under context parallelism (tp={par.tp} +sp, cp={par.cp} {par.cp_scheme}"
                f"{', balanced' if par.cp_balanced and par.cp_scheme != 'ulysses' else ''}) has no compiler lowering: "
                f"a sequence split on tp nested inside balanced chunks or heads split on cp has no layout; the plan "
                f"cannot be compiled or verified as costed (sequence_parallel=False, or cp_balanced=False with the "
                f"allgather or ring scheme, lowers)")
    missing = [CP_MISSING[k] for k in CP_MISSING if k == par.cp_scheme]
    if not missing:
        return None
    return (f"context parallelism (cp={par.cp}, {par.cp_scheme}{', balanced' if par.cp_balanced else ''}) has no "
            f"compiler lowering: missing {' and '.join(missing)}; the plan cannot be compiled or verified without "
            f"changing its cp scheme (cp_scheme='allgather' lowers)")


def lowers(par: Parallel) -> bool:
    """Whether the compiler lowers ``par`` (:func:`cp_refusal` has nothing against it): what a search for a
    plan to compile admits (:func:`nnscaler.cluster.autodist.parallelize`)."""
    return cp_refusal(par) is None
CP_DEFAULTS = {"cp": 1, "cp_scheme": CP_SCHEMES[0], "cp_balanced": True}  # what a file written before cp means


def stage_policy(par: Parallel) -> str:
    """The per-operator policy of one pipeline stage of ``par``: with context parallelism ``cp_tp`` (dp x cp x
    tp), ``cp_tp_balanced`` (its chunks causally balanced), ``cp_tp_ring`` / ``cp_tp_ring_balanced`` (the ring
    scheme), ``ulysses`` (dp x cp, heads split inside attention) or ``cp_tp_ulysses`` (the same under tp), else
    ``hybrid`` (dp x tp), ``tp`` or ``dp``."""
    if par.cp > 1 and par.cp_scheme == "ring":
        return "cp_tp_ring_balanced" if par.cp_balanced else "cp_tp_ring"
    if par.cp > 1:
        if par.cp_scheme == "ulysses":
            return "cp_tp_ulysses" if par.tp > 1 else "ulysses"
        return "cp_tp_balanced" if par.cp_balanced else "cp_tp"
    if par.tp > 1 and par.dp > 1:
        return "hybrid"
    return "tp" if par.tp > 1 else "dp"


def lower(par: Parallel, precision: str = "32-true", **extra) -> tuple[str, ComputeConfig]:
    """``(policy, config)`` the compiler runs for ``par`` on ``par.world`` ranks (``extra``: more
    :class:`ComputeConfig` fields, e.g. ``seed`` or ``profile``). Rank order is Megatron-LM's: tp
    innermost, then cp, then dp, then pipeline stages. A plan whose cp scheme the compiler lacks is a
    :class:`PlanError` naming it (:func:`cp_refusal`)."""
    refusal = cp_refusal(par)
    if refusal:
        raise PlanError(refusal)
    if par.cp > 1:
        extra = {"cp_size": par.cp, **extra}
    return stage_policy(par), ComputeConfig(
        par.world, tp_size=par.tp, pp_size=par.pp, schedule=par.schedule, virtual_stages=par.virtual_stages,
        sequence_parallel=par.sequence_parallel and par.tp > 1, num_microbatches=par.num_microbatches,
        recompute=par.recompute, zero=par.zero if par.dp > 1 else 0, precision=precision, **extra)


def lowered_dict(par: Parallel, precision: str) -> dict | None:
    """What :func:`lower` gives, as JSON: ``{"policy": ..., "config": {field: value}}``; ``None`` for a plan
    whose context parallelism has no lowering (:func:`cp_refusal`); ``cp_size`` only where ``cp`` > 1."""
    if cp_refusal(par):
        return None
    policy, cfg = lower(par, precision)
    return {"policy": policy, "config": {k: getattr(cfg, k) for k in LOWERED_FIELDS + (("cp_size",) if par.cp > 1 else ())}}


def architecture_of(model) -> dict | None:
    """The ``transformers`` model inside ``model`` (itself or a submodule) as JSON: its class and the
    config fields that differ from the defaults, plus the attention implementation it was traced with;
    ``None`` when there is none (such a plan saves, but cannot be rebuilt at a reduced size)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # not installed: no transformers model can be inside
        return None
    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None:
        return None
    cfg = hf.config.to_diff_dict()
    for k in ("torch_dtype", "dtype", "transformers_version", "_name_or_path", "architectures"):
        cfg.pop(k, None)
    cfg["model_type"] = hf.config.model_type
    return {"transformers": type(hf).__name__, "config": cfg,
            "attn_implementation": getattr(hf.config, "_attn_implementation", None) or "eager",
            "wrapped": hf is not model}


@dataclass(frozen=True)
class SavedPlan:
    """A cluster plan read back from its file (:func:`load`)."""

    path: Path
    data: dict
    parallel: Parallel
    precision: str
    seq: int
    architecture: dict | None

    @property
    def world(self) -> int:
        return self.parallel.world

    def lower(self, precision: str | None = None, **extra) -> tuple[str, ComputeConfig]:
        """:func:`lower` of this plan (``precision``: another recipe than the plan's)."""
        return lower(self.parallel, precision or self.precision, **extra)


def _bad(path, what: str) -> PlanError:
    return PlanError(f"{path}: {what}")


def parallel_of(d: object, where: str = "parallel") -> Parallel:
    """The :class:`Parallel` a saved ``parallel`` dict names, every key checked (one-line :class:`PlanError`)."""
    if not isinstance(d, dict):
        raise PlanError(f"{where} must be an object with {', '.join(CONSTRAINT_KEYS)}")
    fields = {f.name for f in dataclasses.fields(Parallel)}
    missing = sorted(fields - set(d) - set(CP_DEFAULTS))
    if missing:
        raise PlanError(f"{where} lacks {', '.join(missing)}")
    kw = {k: d.get(k, CP_DEFAULTS.get(k)) for k in fields}
    for k, v in kw.items():
        if k == "recompute":
            if v not in RECOMPUTE_CHOICES:
                raise PlanError(f"{where}.recompute={v!r}: valid {', '.join(map(repr, RECOMPUTE_CHOICES))}")
        elif k == "cp_scheme":
            if v not in CP_SCHEMES:
                raise PlanError(f"{where}.cp_scheme={v!r}: valid {', '.join(map(repr, CP_SCHEMES))}")
        elif k in ("sequence_parallel", "cp_balanced"):
            if not isinstance(v, bool):
                raise PlanError(f"{where}.{k}={v!r}: must be true or false")
        elif isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "zero" else 1):
            raise PlanError(f"{where}.{k}={v!r}: must be a positive integer")
    if kw["zero"] > 3:
        raise PlanError(f"{where}.zero={kw['zero']}: valid 0, 1, 2, 3")
    par = Parallel(**kw)
    if "schedule" in d and d["schedule"] != par.schedule:
        raise PlanError(f"{where}.schedule={d['schedule']!r} disagrees with virtual_stages={par.virtual_stages} "
                        f"({par.schedule!r})")
    if par.virtual_stages > 1 and par.num_microbatches % par.pp:
        raise PlanError(f"{where}: {par.num_microbatches} micro-batches under {par.pp} stages with virtual stages: "
                        f"interleaved 1F1B needs a multiple of pp")
    return par


def load(path: str | os.PathLike) -> SavedPlan:
    """Read a plan :meth:`ClusterPlan.save` wrote; anything missing or inconsistent is one
    :class:`PlanError` line naming the file and the field."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise _bad(p, "no such file") from None
    except IsADirectoryError:
        raise _bad(p, "is a directory, not a plan file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _bad(p, f"cannot read: {exc}") from None
    except ValueError as exc:
        raise _bad(p, f"not JSON ({exc}); a plan file is what plan.save(path) writes") from None
    if not isinstance(data, dict) or data.get("policy") != "cluster":
        raise _bad(p, "not a cluster plan (no \"policy\": \"cluster\"); write one with plan_cluster(...).save(path)")
    if data.get("format") != FORMAT:
        raise _bad(p, f"format {data.get('format')!r} is not {FORMAT!r}; save the plan again with this version")
    try:
        par = parallel_of(data.get("parallel"))
    except PlanError as exc:
        raise _bad(p, str(exc)) from None
    world = data.get("world_size")
    if world != par.world:
        raise _bad(p, f"world_size {world!r} is not tp x cp x pp x dp = {par.tp} x {par.cp} x {par.pp} x {par.dp} = "
                      f"{par.world}")
    precision = data.get("precision")
    if precision not in PRECISIONS:
        raise _bad(p, f"precision {precision!r}: valid {', '.join(PRECISIONS)}")
    seq = data.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise _bad(p, f"seq {seq!r}: must be a positive integer")
    arch = data.get("architecture")
    if arch is not None and not (isinstance(arch, dict) and isinstance(arch.get("transformers"), str)
                                 and isinstance(arch.get("config"), dict)):
        raise _bad(p, "architecture must be null or {\"transformers\": CLASS, \"config\": {...}}")
    return SavedPlan(p, data, par, precision, seq, arch)


def _weight_split(op, plan, axis: int) -> str:
    """How ``plan`` places ``op``'s first parameter on mesh ``axis``: ``D0``, ``D1``, ``R`` or ``V``."""
    from ..ir.graph import PARAM, IRTensor
    pos = next(i for i, x in enumerate(op.inputs) if isinstance(x, IRTensor) and x.kind == PARAM)
    return str(op.layout(plan.partition(op)).inputs[pos][axis])


def check_lowering(model, sample_args, par: Parallel, precision: str = "32-true", policy=None) -> list[str]:
    """Where the per-operator plan the compiler makes for ``par`` (:func:`lower`, one stage's ranks)
    splits a parameter of a linear or an embedding on the tp axis otherwise than the cost model costed
    it (:mod:`nnscaler.cluster.blocks`: column-parallel weights split along their output dim (``D0``),
    row-parallel along their input (``D1``), embeddings by vocabulary (``D0``)); one line per operator,
    none when the compiler runs the plan that was costed. ``sample_args``: one micro-batch of every dp
    rank, a ``(batch, seq)`` tensor of token ids first. ``policy``: check another per-operator policy
    (a name or function) than the lowering's against the costed splits."""
    if par.tp == 1:
        return []
    from ..compile.plan import choose_plan, trace_model
    from ..policies.pipeline import stage_config
    from .blocks import model_shape
    lowered, config = lower(par, precision)
    policy = lowered if policy is None else policy
    graph = trace_model(model, sample_args, None, registry=None, strict=False)
    shape = model_shape(graph, int(sample_args[0].shape[0]), int(sample_args[0].shape[1]))
    plan = choose_plan(graph, policy, stage_config(config))
    axis = plan.axis_names.index("tp") if "tp" in plan.axis_names else len(plan.mesh_shape) - 1  # tp innermost
    ops = {op.name: op for op in graph.ops}
    out = []
    for f in (*shape.pre.ops, *shape.block.ops, *shape.post.ops):
        if f.kind not in ("linear", "lookup") or f.name not in ops:
            continue
        want = "D0" if f.kind == "lookup" or f.column else "D1"
        got = _weight_split(ops[f.name], plan, axis)
        if got != want:
            kind = "vocabulary-parallel" if f.kind == "lookup" else "column-parallel" if f.column else "row-parallel"
            op = ops[f.name]
            out.append(f"{f.name} ({'.'.join(op.scope[-1:]) or op.overload}) costed {kind} (weight {want} on tp), "
                       f"planned {got} by policy {getattr(policy, '__name__', policy)}")
    return out
