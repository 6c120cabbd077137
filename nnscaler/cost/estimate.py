"""What a plan costs per rank: state and activation bytes, the collectives of a training step (read
from the very conversion steps the code generator emits, plus gradient sync), and its step time."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from ..codegen.emit import emit_program, shard_slices, stored_layouts, synced_params
from ..dimops.layout import Layout, Shard, layout_str
from ..ir.graph import ACTIVATION, PARAM, IRGraph, IRTensor
from ..runtime.grad_sync import BUCKET_BYTES
from .comm import collective_time, spans_nodes
from .compute import op_time, optimizer_time
from ..profiles import DeviceProfile
from .saved import saved_bytes
from . import summary as printing
from .steps import (OPTIMIZER_STATES, Collective, carries_grad, coalesced_into, coupled_collectives,
                    exchange_collectives, local_nbytes, nbytes,
                    step_collectives)

@dataclass
class PlanStats:
    """Per-rank costs of a plan (every list has one entry per plan rank)."""

    profile: str
    param_bytes: list[int]
    grad_bytes: list[int]
    optim_bytes: list[int]
    buffer_bytes: list[int]
    activation_bytes: list[int]
    single_device: dict[str, int]
    sharded: list[tuple[str, tuple[int, ...], str]]  # (name, full shape, layout) of split state
    replicated_params: int
    collectives: list[Collective]
    compute_seconds: float
    comm_seconds: float
    replicated_ops: list[tuple[str, str, str]] = field(default_factory=list)
    inferred: list[tuple[str, str]] = field(default_factory=list)  # (operator, annotation) found by probing
    guards: list[str] = field(default_factory=list)  # the model's lines whose data-dependent branch or size the trace fixed
    # the guards on the model's state that failed at run time, each remade for the branch the state took (in order)
    respecialised: list[str] = field(default_factory=list)
    zero: int = 0  # the ZeRO stage costed
    zero_ranks: int = 1  # the ranks each parameter's ZeRO state is sharded over (the dp axis x the replicas)
    # () -> one line per cause of the forward collectives (nnscaler/cost/causes.py), made when a report asks
    causes: Callable[[], list[str]] | None = field(default=None, repr=False, compare=False)

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds

    @property
    def peak_bytes(self) -> list[int]:
        return [sum(x) for x in zip(self.param_bytes, self.grad_bytes, self.optim_bytes, self.buffer_bytes,
                                    self.activation_bytes)]

    def summary(self, plan) -> dict:
        return printing.summary(plan, self)

    def report(self, plan) -> str:
        return printing.report(plan, self)

    def one_line(self, plan) -> str:
        return printing.one_line(plan, self)


def analyze(graph: IRGraph, plan, profile: DeviceProfile, replicas: int = 1, steps: list | None = None,
            zero: int = 0, recompute: str = "none", recompute_modules=None) -> PlanStats:
    """Costs of ``plan`` on ``graph``; ``replicas`` data-parallel copies of the plan sync gradients.
    ``steps``: the conversion steps of the plan's program when the caller emitted it already (any rank's:
    every rank takes the same steps), so the program is emitted once per plan. The recipe: ``zero``
    (:func:`zero_shards`), ``recompute`` and ``recompute_modules`` (:func:`nnscaler.cost.saved.saved_bytes`;
    ``bf16-mixed`` is read from the graph's casts)."""
    mesh, names = plan.mesh_shape, plan.axis_names
    world = plan.world_size
    stored = stored_layouts(graph, plan)
    synced = synced_params(graph, plan)
    params = {t for t in graph.params}
    per_rank = {k: [0] * world for k in ("param", "buffer")}
    for t, lay in stored.items():
        for r in range(world):
            # (start, stop) per dim, or (start, stop, blocks): that range in each block
            n = math.prod((sl[1] - sl[0]) * (sl[2] if len(sl) > 2 else 1)
                          for sl in shard_slices(t.shape, lay, mesh, r)) * t.dtype.itemsize
            per_rank["param" if t in params else "buffer"][r] += n
    params_kept, grads, optim = zero_shards(graph, plan, stored, replicas, zero)
    sharded = [(t.target or t.name, t.shape, layout_str(lay)) for t, lay in stored.items()
               if any(isinstance(q, Shard) for q in lay)]
    steps = emit_program(graph, plan, 0).steps if steps is None else steps
    ranks_here = min(world * replicas, profile.ranks_per_node)
    colls = []
    lead = None  # where the forward collective of a coalesced group is (its later members ride in it)
    for t, before, step in steps:
        made = step_collectives(t, before, step, mesh, names, profile)
        if step.coalesced and lead is not None:
            colls[lead] = coalesced_into(colls[lead], made[0], mesh, step.axis, profile)
            made = made[1:]
        elif made and made[0].phase == "forward":
            lead = len(colls)
        colls += made
    colls += coupled_collectives(graph, plan, profile)
    colls += exchange_collectives(graph, plan, profile)  # ring attention's sends (inside its kernel)
    dp = zero_axis(names, mesh)
    zero_ranks = (mesh[dp] if dp is not None else 1) * replicas if zero else 1
    by_axis: dict[int, list[int]] = defaultdict(list)
    for t, axis in synced.items():
        by_axis[axis].append(local_nbytes(t, stored[t], mesh))
    for axis, sizes in sorted(by_axis.items()):
        if zero_ranks > 1 and axis == dp:
            continue  # the zero group's collectives below sync these
        colls += _buckets(sizes, mesh[axis], names[axis], profile, spans_nodes(mesh, axis, profile))
    if zero_ranks > 1:
        synced_dp = [local_nbytes(t, stored[t], mesh) for t in graph.params if replicas > 1 or synced.get(t) == dp]
        colls += zero_collectives(synced_dp, zero_ranks, "dp" if replicas == 1 else "dp x replicas" if dp is not None
                                  else "replicas", profile, world * replicas > profile.ranks_per_node, zero)
    elif replicas > 1:
        colls += _buckets([local_nbytes(t, stored[t], mesh) for t in graph.params], replicas, "replicas", profile,
                          world * replicas > profile.ranks_per_node)
    compute = sum(op_time(op, plan.partition(op) if op.known else None, profile, ranks_here) for op in graph.ops)
    compute += optimizer_time(max(per_rank["param"]), profile, ranks_here)
    act = saved_bytes(graph, plan, recompute, recompute_modules)
    whole_params = sum(nbytes(t) for t in graph.params)
    single = {"param": whole_params, "grad": whole_params, "optim": OPTIMIZER_STATES * whole_params,
              "buffer": sum(nbytes(t) for t in graph.buffers),
              "activation": saved_bytes(graph, None, recompute, recompute_modules)}
    return PlanStats(profile.name, params_kept, grads, optim,
                     per_rank["buffer"], [act] * world, single, sharded,
                     sum(1 for t in graph.params if not any(isinstance(q, Shard) for q in stored[t])),
                     colls, compute, sum(c.seconds for c in colls), zero=zero, zero_ranks=zero_ranks)


def zero_axis(names, mesh) -> int | None:
    """The mesh axis ZeRO shards over (as :func:`nnscaler.compile.zero.dp_axis`): ``dp``, or failing
    it ``cp`` (parameters whole there too), of more than one rank; else ``dp`` (or ``None``)."""
    names = list(names)
    return next((names.index(n) for n in ("dp", "cp") if n in names and mesh[names.index(n)] > 1),
                names.index("dp") if "dp" in names else None)


def zero_shards(graph: IRGraph, plan, stored: dict, replicas: int, zero: int) -> tuple[list[int], list[int], list[int]]:
    """Per plan rank, bytes of parameters, gradients (one per parameter element, in its dtype) and
    AdamW state under ZeRO stage ``zero`` (:mod:`nnscaler.runtime.zero`): a parameter is sharded over
    the ranks holding the same piece of it, the plan's ``dp`` axis (where it is not split along it) times
    the ``replicas``; stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters."""
    mesh = plan.mesh_shape
    axis = zero_axis(plan.axis_names, mesh)
    dp = mesh[axis] if axis is not None else 1
    out = {k: [0] * plan.world_size for k in ("param", "grad", "optim")}
    for t, lay in stored.items():
        if t not in set(graph.params):
            continue
        split_on_dp = axis is not None and isinstance(lay[axis], Shard)
        n = replicas * (1 if split_on_dp else dp) if zero else 1
        for r in range(plan.world_size):
            b = math.prod((sl[1] - sl[0]) * (sl[2] if len(sl) > 2 else 1)
                          for sl in shard_slices(t.shape, lay, mesh, r)) * t.dtype.itemsize
            out["param"][r] += b // n if zero >= 3 else b
            out["grad"][r] += b // n if zero >= 2 else b
            out["optim"][r] += OPTIMIZER_STATES * b // n
    return out["param"], out["grad"], out["optim"]


def bucket_bytes(sizes: list[int], limit: int = BUCKET_BYTES) -> list[int]:
    """Bytes of each gradient bucket, filled as :meth:`nnscaler.runtime.grad_sync.GradSync.build`
    fills them: in reverse order, a bucket closed once it holds ``limit`` bytes."""
    out: list[int] = []
    for n in reversed(sizes):
        if not out or out[-1] >= limit:
            out.append(0)
        out[-1] += n
    return out


def _buckets(sizes: list[int], f: int, axis: str, profile: DeviceProfile, across: bool) -> list[Collective]:
    """Gradient all-reduces of parameters of ``sizes`` bytes, in buckets as the runtime sends them."""
    return [Collective("grad sync", "all_reduce", axis, f, n, collective_time("all_reduce", n, f, profile, across))
            for n in bucket_bytes(sizes)]


def zero_collectives(sizes: list[int], f: int, axis: str, profile: DeviceProfile, across: bool,
                     zero: int) -> list[Collective]:
    """The collectives :mod:`nnscaler.runtime.zero` issues per step over a zero group of ``f`` ranks, in
    buckets of parameters of ``sizes`` bytes: stage 1 all-reduces each bucket's gradient, stage 2
    reduce-scatters it, and both all-gather the updated parameter shards after the step; stage 3
    reduce-scatters too, and all-gathers each bucket's parameters before its use in forward and again
    in backward (kept sharded after the step)."""
    out = []
    for n in bucket_bytes(sizes):
        gather = collective_time("all_gather", n, f, profile, across)
        if zero >= 3:
            out += [Collective("forward", "all_gather", axis, f, n, gather),
                    Collective("backward", "all_gather", axis, f, n, gather)]
        sync = "reduce_scatter" if zero >= 2 else "all_reduce"
        out.append(Collective("grad sync", sync, axis, f, n, collective_time(sync, n, f, profile, across)))
        if zero < 3:
            out.append(Collective("grad sync", "all_gather", axis, f, n, gather))
    return out
