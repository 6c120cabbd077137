"""A program per branch of the model's state, as torch.compile recompiles on a failed guard.

A branch on a buffer's value (I-BERT's ``QuantAct``: ``if self.x_min.min() > -1.1e-5 and ...``, true on
the zero buffers of the first step, false from the second on) is traced on the branch the sample takes
and guarded (:mod:`nnscaler.trace.branches`); a guard alone would stop training at the second step. When
such a guard (one that reads the model's state alone) fails, :class:`~nnscaler.runtime.module.ParallelModule`
calls :class:`Respecialiser`: every rank, alike, merges the module's state, loads it into the
single-device model, traces that again on the failing input (which now takes the other branch), plans
it with the same policy and config (:func:`planned`, :func:`emitted`: the steps ``parallelize`` takes)
and hands back the program, which the module runs on its own parameters (and so the optimizer's state)
when it lays them out exactly as the old one did. A guard on the input is never respecialised: it raises."""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from ..codegen.emit import Emitter, emit_program, stored_layouts
from ..config import ComputeConfig, PlanWarning
from ..ir.graph import GUARD, IRGraph
from ..ir.plan import Plan, Policy
from ..ops.registry import OpRegistry
from ..runtime.program import GuardFailed
from ..trace.build import Tracer
from .artifacts import load_program
from .gate import verify_on_ranks
from .plan import attach_stats, choose_plan, trace_model, write_report
from .precision import apply_precision
from .writes import ops_over_replicas, over_replicas
from .zero import check_zero


class RespecialisedWarning(PlanWarning):
    """A guard on the model's state failed at run time: the program was made again for the branch the
    state now takes (once per branch; the plan report counts them)."""


def planned(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None, policy: str | Policy,
            config: ComputeConfig, name: str, *, registry: OpRegistry | None, strict: bool,
            tracer: Tracer | None = None) -> tuple[IRGraph, Plan]:
    """The traced graph and its checked plan, before any process group: trace, refuse what the config
    cannot keep equal (buffer writes, ZeRO), plan (a buffer written from the batch under replicas: the
    operators mixing its rows run over every replica's), and the precision's casts."""
    graph = trace_model(model, args, kwargs, registry=registry, strict=strict, tracer=tracer)
    rows = ops_over_replicas(graph, config)  # a buffer written from the batch under replicas (or refused by name)
    plan = choose_plan(graph, policy, config)  # a policy's bad answer is refused before any process group
    plan = over_replicas(plan, graph, rows, config.replicas)
    apply_precision(graph, config.precision)  # bf16-mixed: the casts autocast makes (before any process group)
    check_zero(plan, config, name)
    return graph, plan


def emitted(graph: IRGraph, plan: Plan, config: ComputeConfig, plan_rank: int) -> Emitter:
    """Plan rank ``plan_rank``'s program, emitted once (the cost estimate reads its steps)."""
    out = emit_program(graph, plan, plan_rank, recompute=config.recompute, recompute_modules=config.recompute_modules)
    attach_stats(plan, graph, config, out.steps)
    return out


def state_guards(graph: IRGraph) -> list[str]:
    """The model's lines of the guards that read its state alone (a program is respecialised on them)."""
    return list(dict.fromkeys(op.source for op in graph.ops if op.overload == GUARD and op.kwargs.get("on_state")))


@contextmanager
def holding(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Within: ``model``'s parameters and buffers hold ``state`` (whole tensors by name: those the
    program holds; one it does not read was never written and holds its value already); after, what
    they held before (the caller's model is left as it was)."""
    own = {n: t for n, t in {**dict(model.named_buffers()), **dict(model.named_parameters())}.items() if n in state}
    saved = {n: t.detach().clone() for n, t in own.items()}
    try:
        with torch.no_grad():
            for n, t in own.items():
                t.copy_(state[n])
        yield
    finally:
        with torch.no_grad():
            for n, t in own.items():
                t.copy_(saved[n])


@contextmanager
def _generators_kept() -> Iterator[None]:
    """Within: random draws leave the generators' states as they were before."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


def _agreed(digest: str, group) -> bool:
    """Whether every rank of ``group`` made the program of the same ``digest``."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    mine = torch.tensor([int(digest[:15], 16)], dtype=torch.int64)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return int(lo) == int(hi)


class Respecialiser:
    """What ``parallelize`` hands a module to make its program again for another branch of the
    model's state: the model, the policy and config, and where programs and the plan report go.
    Called by every rank of the module alike (it gathers the state and agrees on the program)."""

    def __init__(self, model: torch.nn.Module, policy: str | Policy, config: ComputeConfig, name: str, *,
                 plan_rank: int, key: list[str], label: str, directory: Path, reuse: bool,
                 registry: OpRegistry | None, strict: bool, verify: Any, verifier: Any, groups, user_groups: bool,
                 verify_cache: Any, report: bool):
        self.model, self.policy, self.config, self.name = model, policy, config, name
        self.plan_rank, self.key, self.label, self.directory, self.reuse = plan_rank, key, label, directory, reuse
        self.registry, self.strict = registry, strict
        self.verify, self.verifier, self.groups, self.user_groups, self.verify_cache = \
            verify, verifier, groups, user_groups, verify_cache
        self.report = report  # this rank writes the plan report and says the warning (rank 0)
        self.made = 0

    def __call__(self, module, failed: GuardFailed, inputs: Sequence[Any]) -> tuple:
        """``(program, plan, graph)`` for the branch ``inputs`` take on ``module``'s current state."""
        state = module.whole_state()  # collective: every rank of the module is here, the guard failed alike
        # the trace is for training whatever the caller's forward runs under (no_grad, saved-tensor hooks), and
        # draws nothing from the caller's random generators
        with holding(self.model, state), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), _generators_kept():
            # traced afresh: a caller's tracer may hand back a graph cached by the inputs' shapes (verify's is)
            graph, plan = planned(self.model, tuple(inputs), None, self.policy, self.config, self.name,
                                  registry=self.registry, strict=self.strict)
        # each tensor held as the running program holds it (the policy may want another split of it for this
        # branch): the module's parameters, and with them the optimizer's state, carry over piece for piece
        # (only where they differ: a branch flipping back makes its first program again, the same text)
        wants = {t.target or t.name: tuple(str(q) for q in lay) for t, lay in stored_layouts(graph, plan).items()}
        plan.held = {n: tuple(entry[1]) for n, entry in module._program.STATE.items()
                     if n in wants and wants[n] != tuple(entry[1])}
        verify_on_ranks(graph, plan, self.config, self.verify, self.verifier, self.groups, self.user_groups,
                        self.verify_cache)
        self.made += 1
        program, digest = load_program(graph, plan, emitted(graph, plan, self.config, self.plan_rank),
                                       plan_rank=self.plan_rank, key=self.key, label=self.label,
                                       directory=self.directory / f"branch_{self.made}", reuse=self.reuse)
        if not _agreed(digest, module.process_group):
            raise GuardFailed(f"{failed}; traced again on this rank's input and state, the ranks made different "
                              f"programs (their inputs take different branches)", failed.name, failed.where,
                              failed.text, True)
        before = getattr(module.plan.stats, "respecialised", []) if module.plan.stats is not None else []
        plan.stats.respecialised = [*before, f"{failed.where} ({failed.text} failed)"]
        if self.report:
            path = failed.where.partition(": ")[0]
            file, _, line = path.rpartition(":")
            message = (f"{self.label}: the guard at {failed.where} failed at run time ({failed.text} no longer holds "
                       f"on the model's state): traced again on the current state and input, planned by {self.name}, "
                       f"and run on the same parameters (program {self.made + 1} of this module, kept for that branch)")
            if line.isdigit():  # said at the model's line, as the trace's SpecialisedBranchWarning is
                warnings.warn_explicit(message, RespecialisedWarning, file, int(line))
            else:
                warnings.warn(message, RespecialisedWarning, stacklevel=2)
            write_report(plan, self.directory)
        return program, plan, graph
