"""``autodist``: plan search as an integer program solved by HiGHS, over rank meshes and the dimops
partition space of every operator, under a per-rank memory budget.

Every mesh ``dp x tp`` with ``dp * tp = W`` is searched (``W`` alone as pure ``dp`` and as pure
``tp`` too): the ``dp`` axis splits the batch or nothing, the ``tp`` axis any other splittable
identifier or nothing. Each mesh's program (:mod:`.autodist_program`) is solved; the plan with the
smallest estimated step time that fits ``ComputeConfig(mem_budget=...)`` wins. We build the program
ourselves (HiGHS only solves): no library maps dimops partition spaces to an integer program.
"""
from __future__ import annotations

import ctypes
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass

import highspy
import numpy as np
import torch.distributed as dist

from ..cost.compute import op_flops
from ..profiles import get_profile
from ..dimops.partition import splittable
from ..ir.graph import IRGraph, IROp
from .autodist_program import Program, Shared, build_program, op_classes
from .builtin import batch_identifiers
from .greedy import candidates, fused_blocks, plan_greedy
from ..config import ComputeConfig, PlanError, PlanWarning
from ..cost.summary import human, seconds
from ..ir.plan import Plan, validate

# Every rank runs the search and must reach the same plan, so the search is bounded by work (branch-
# and-bound nodes; HiGHS is deterministic on one thread), not by the clock; the time limit is only a
# fail-safe. A mesh where HiGHS stops short of optimal keeps the solver's best plan (its incumbent) when
# the stop is by work or numerics; at the time limit, or without an incumbent, it takes the greedy plan
# on that mesh (an incumbent found by the clock may differ between ranks; the greedy plan does not), and
# the plan's note and a PlanWarning say which and why (:func:`short_of_optimal`).
MIP_NODES = 2000
TIME_LIMIT = 120.0  # seconds per mesh
_MS = 1e3  # the objective in milliseconds keeps HiGHS's tolerances meaningful
COST_CAP = 1e15  # ms; HiGHS reads a cost from 1e20 on as infinite (the model is then 'Unknown'): capped below
MIP_GAP = 0.005  # stop within 0.5% of the best bound: the cost model is not finer than that


@dataclass
class Solution:
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    status: str
    choice: list[int] | None = None  # candidate index per class
    seconds: float = math.inf
    memory: float = math.inf
    variables: int = 0  # the integer program's size (0: not built)
    constraints: int = 0
    solve_seconds: float = 0.0
    short: str = ""  # how HiGHS stopped short of optimal and what the plan is instead; "" where it did not
    partitions: dict | None = None  # the plan where it is not one candidate per class (the greedy fallback)

    @property
    def stopped(self) -> bool:
        """HiGHS stopped without proving this mesh infeasible or beaten, and without a plan."""
        return self.choice is None and not self.status.startswith(PROVEN)

    def size(self) -> str:
        return (f"IP {self.variables} variables, {self.constraints} constraints, {self.solve_seconds:.2f} s"
                if self.variables else "no IP")


PROVEN = ("Optimal", "Infeasible", "infeasible", "Objective bound", "no faster plan")  # a proof, not a stop


def meshes(world: int) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """Pure dp, pure tp, then every 2-D ``dp x tp`` factorisation of ``world``."""
    if world == 1:
        return [((1,), ("dp",))]
    out = [((world,), ("dp",)), ((world,), ("tp",))]
    out += [((d, world // d), ("dp", "tp")) for d in range(2, world) if world % d == 0]
    return out


def axis_options(axis_names, batch: dict[str, str | None]):
    """The greedy planner's option function for these axis roles."""
    def options(op: IROp, axis: int, layouts: dict):
        b = batch[op.name]
        if axis_names[axis] == "dp":
            return [b, None] if b is not None else [None]
        return [None, *(i for i in splittable(op.bound) if i != b)]
    return options


def _decomposes(mat: np.ndarray) -> bool:
    """Whether ``mat[i, j] == a[i] + b[j]`` (then it is two unary costs, no pair variables)."""
    return np.allclose(mat, mat[:, :1] + mat[:1, :] - mat[0, 0], rtol=1e-9, atol=1e-15)



def _new_highs() -> "highspy.Highs":
    """A HiGHS instance, without the banner HiGHS prints on its first construction in a process. It
    is C++ output that no option can turn off before the instance exists, so stdout is pointed at
    the null device, at the file descriptor, while it is made."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
        h = highspy.Highs()
        ctypes.CDLL(None).fflush(None)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return h

def solve(prog: Program, budget: float | None, time_limit: float, minimize_memory: bool = False,
          relax: bool = False, cutoff: float | None = None, nodes: int = MIP_NODES) -> Solution:
    """Solve one mesh's program with HiGHS (minimum step time under ``budget``, or minimum memory).
    ``relax``: only the linear relaxation (its ``seconds`` bound every plan on the mesh from below,
    ``choice`` stays None; ``-inf`` where HiGHS stopped short of its optimum); ``cutoff``: seconds of
    a plan already found (the search proves this mesh cannot beat it, or finds one that does; status
    ``Objective bound`` when it cannot); ``nodes``: HiGHS's branch-and-bound node limit. Where HiGHS
    stops short of optimal (a limit, numerics, 'Unknown'), its incumbent is the plan if it has one and
    the stop was not the clock's (``short`` says so); else ``choice`` stays None (:attr:`Solution.stopped`)."""
    classes = prog.classes
    unary = [s.copy() * _MS for s in prog.seconds]
    pairs = []
    for (u, v), mat in prog.pairs.items():
        mat = mat * _MS
        if _decomposes(mat):
            unary[u] += mat[:, 0] - mat[0, 0]
            unary[v] += mat[0, :]
        else:
            pairs.append((u, v, mat))
    if minimize_memory:
        unary = [m.astype(float) for m in prog.memory]
        pairs = []
    offset, n = [], 0
    for k in classes:
        offset.append(n)
        n += len(k.cands)
    nx = n
    cost = np.concatenate(unary) if unary else np.zeros(0)
    rows: list[tuple[float, float, list[int], list[float]]] = []
    for k, c in enumerate(classes):
        rows.append((1.0, 1.0, list(range(offset[k], offset[k] + len(c.cands))), [1.0] * len(c.cands)))
    pair_costs = []
    for u, v, mat in pairs:
        cu, cv = mat.shape
        base = n
        n += cu * cv
        pair_costs.append(mat.reshape(-1))
        for a in range(cu):
            rows.append((0.0, 0.0, [base + a * cv + b for b in range(cv)] + [offset[u] + a], [1.0] * cv + [-1.0]))
        for b in range(cv):
            rows.append((0.0, 0.0, [base + a * cv + b for a in range(cu)] + [offset[v] + b], [1.0] * cu + [-1.0]))
    for g in prog.shared if not minimize_memory else ():
        n = _add_shared(g, offset, classes, n, rows, pair_costs)
    if budget is not None and not minimize_memory:
        mem = np.concatenate(prog.memory)
        rows.append((-highspy.kHighsInf, budget - prog.fixed_memory, list(range(nx)), list(mem)))
    sol = Solution(prog.mesh_shape, prog.axis_names, "Optimal")
    if not classes:  # nothing to choose (no annotated operator): HiGHS calls an empty model 'Empty'
        seconds, memory = prog.evaluate([])
        if budget is None or minimize_memory or memory <= budget:
            sol.choice, sol.seconds, sol.memory = [], seconds, memory
        return sol
    h = _new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", max(0.0, time_limit))
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", MIP_GAP)
    h.setOptionValue("mip_max_nodes", nodes)
    if cutoff is not None and not relax:
        h.setOptionValue("objective_bound", (cutoff - prog.fixed_seconds) * _MS)
    costs = np.minimum(np.concatenate([cost, *pair_costs]) if pair_costs else cost, COST_CAP)
    h.addCols(n, costs, np.zeros(n), np.ones(n), 0, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
    if not relax:
        h.changeColsIntegrality(nx, np.arange(nx, dtype=np.int32),
                                np.array([highspy.HighsVarType.kInteger] * nx))
    starts, idx, vals = [], [], []
    for _, _, cols, coefs in rows:
        starts.append(len(idx))
        idx += cols
        vals += coefs
    h.addRows(len(rows), np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), len(idx),
              np.array(starts, np.int32), np.array(idx, np.int32), np.array(vals, float))
    clock = time.perf_counter()
    h.run()
    status = h.getModelStatus()
    text = h.modelStatusToString(status)
    has_solution = h.getInfo().primal_solution_status == 2
    sol = Solution(prog.mesh_shape, prog.axis_names, text, variables=n, constraints=len(rows),
                   solve_seconds=time.perf_counter() - clock)
    if status == highspy.HighsModelStatus.kInfeasible or (
            status == highspy.HighsModelStatus.kObjectiveBound and not has_solution):
        return sol
    if relax:
        optimal = status == highspy.HighsModelStatus.kOptimal
        sol.seconds = prog.fixed_seconds + h.getInfo().objective_function_value / _MS if optimal else -math.inf
        return sol
    timed_out = status == highspy.HighsModelStatus.kTimeLimit
    if status != highspy.HighsModelStatus.kOptimal and (timed_out or not has_solution):
        return sol  # stopped short without a plan to trust: the caller falls back (choice None)
    x = np.array(h.getSolution().col_value[:nx])
    sol.choice = [int(np.argmax(x[offset[k]:offset[k] + len(c.cands)])) for k, c in enumerate(classes)]
    sol.seconds, sol.memory = prog.evaluate(sol.choice)
    if status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kObjectiveBound):
        sol.short = f"HiGHS stopped short of optimal (status {text!r}): its best plan found so far"
    return sol


def _add_shared(g: Shared, offset: list[int], classes, n: int, rows: list, costs: list) -> int:
    """Columns and rows of one shared tensor. ``s[k]``: layout ``k`` is made, ``s[k] >= x[v, c]`` for
    every reader's candidate ``c`` wanting it (minimised, so the OR of binaries). With a producer
    class ``u``, ``z[c, k] = x[u, c] AND s[k]`` pays the conversion from ``u``'s candidate ``c``, as
    ``z[c, k] <= x[u, c]`` and ``sum_c z[c, k] = s[k]``: the marginal form, as for pairs (a tight
    relaxation; ``z >= x + s - 1`` left HiGHS minutes of branching on Llama). Returns the column count."""
    nc, nk = g.seconds.shape
    s0 = n
    n += nk
    for v, keys in g.consumers:
        for k in set(keys):
            cols = [offset[v] + c for c, kk in enumerate(keys) if kk == k]
            rows.append((0.0, highspy.kHighsInf, [s0 + k] + cols, [1.0] + [-1.0] * len(cols)))
    if g.producer is None:
        costs.append(g.seconds[0] * _MS)
        return n
    costs.append(np.zeros(nk))
    z0 = n
    n += nc * nk
    for k in range(nk):
        rows.append((0.0, 0.0, [z0 + c * nk + k for c in range(nc)] + [s0 + k], [1.0] * nc + [-1.0]))
    for c in range(nc):
        for k in range(nk):
            rows.append((-highspy.kHighsInf, 0.0, [z0 + c * nk + k, offset[g.producer] + c], [1.0, -1.0]))
    costs.append(g.seconds.reshape(-1) * _MS)
    return n


def _heaviest(graph: IRGraph) -> IROp | None:
    """The operator of most FLOPs among those with a dim to split at all: one whose every dim is frozen (a
    boolean-mask ``index_put``: xmod's adapters) stays whole at every world size, so it tells none apart."""
    known = [op for op in graph.ops if op.known and splittable(op.bound)]
    return max(known, key=lambda op: op_flops(op, None)[0], default=None)


def _divides(op: IROp, world: int, batch) -> bool:
    return any(p.degree == world for mesh, names in meshes(world)
               for p in candidates(op, mesh, axis_options(names, batch), {}))


def check_world_size(graph: IRGraph, world: int, batch) -> None:
    """Raise :class:`PlanError` when the heaviest operator cannot be split over ``world`` ranks,
    naming the closest world sizes that work."""
    op = _heaviest(graph)
    if op is None or world == 1 or _divides(op, world, batch):
        return
    near = sorted((w for w in range(2, 4 * world + 1) if w != world), key=lambda w: (abs(w - world), w))
    ok = [w for w in near[:64] if _divides(op, w, batch)][:2]
    lengths = ", ".join(f"{i}={n}" for i, n in op.bound.sizes.items())
    raise PlanError(f"autodist: the model's dims cannot be divided among {world} ranks: its heaviest operator "
                    f"{op.name} ({op.spec.annotation}; {lengths}) has no split of degree {world}; closest world sizes "
                    f"that divide it: {', '.join(map(str, ok)) or 'none'}")


def autodist(graph: IRGraph, config: ComputeConfig, time_limit: float = TIME_LIMIT, nodes: int = MIP_NODES) -> Plan:
    """Search meshes and partitions for the fastest plan (by the cost model of ``config.profile``)
    whose estimated peak memory per rank fits ``config.mem_budget``. ``time_limit`` (seconds per mesh)
    and ``nodes`` (branch-and-bound nodes per mesh) bound HiGHS; a mesh where it stops short of optimal
    keeps its incumbent or takes the greedy plan (:func:`short_of_optimal`), so a model that a greedy
    plan fits never ends in :class:`PlanError` for want of a solver's answer."""
    profile = get_profile(config.profile)
    world = config.plan_ngpus
    batch = batch_identifiers(graph)
    check_world_size(graph, world, batch)
    classes, of = op_classes(graph, batch, fused_blocks(graph))
    start = time.perf_counter()
    progs = []
    for mesh, names in meshes(world):
        prog = build_program(graph, classes, of, mesh, names, axis_options(names, batch), profile, config.replicas)
        prog.classes = [type(k)(k.ops, list(k.cands), list(k.layouts), k.blocks) for k in classes]  # keep this mesh's
        progs.append(prog)
    sols = _search(progs, config.mem_budget, time_limit, nodes)
    for i, sol in enumerate(sols):
        if sol.stopped:
            sols[i] = short_of_optimal(graph, progs[i], sol, batch, config.mem_budget)
    fits = [s for s in sols if s.choice is not None]
    if not fits:
        fallback = built_in_fallback(graph, config, sols)
        if fallback is not None:
            return fallback
        least = min((solve(p, None, time_limit, minimize_memory=True, nodes=nodes) for p in progs),
                    key=lambda s: s.memory)
        reach = (f"the smallest per-rank memory reachable is {human(least.memory)} (mesh {least.mesh_shape} "
                 f"{least.axis_names})" if least.memory < math.inf else
                 "HiGHS found no smallest per-rank memory either")
        raise PlanError(f"autodist: no plan on {world} ranks fits mem_budget={human(config.mem_budget)} per rank "
                        f"(profile {profile.name}); {reach}: raise mem_budget to at least that, or plan "
                        f"for more ranks")
    best_i = min(range(len(sols)), key=lambda i: sols[i].seconds if sols[i].choice is not None else math.inf)
    best, prog = sols[best_i], progs[best_i]
    partitions = best.partitions or {op.name: k.cands[c] for k, c in zip(prog.classes, best.choice) for op in k.ops}
    tried = "; ".join(f"{s.mesh_shape}{'x'.join(s.axis_names)}: "
                      + (f"{'greedy plan, ' if s.partitions else ''}{seconds(s.seconds)}, {human(s.memory)}/rank"
                         if s.choice is not None else s.status) + f" ({s.size()})" for s in sols)
    note = (f"autodist ({profile.name}, budget {human(config.mem_budget) if config.mem_budget else 'none'}, "
            f"{len(classes)} operator classes, {time.perf_counter() - start:.1f} s): chose mesh {best.mesh_shape} "
            f"{best.axis_names}; searched {tried}")
    if best.short:
        note += f"; the chosen mesh's plan: {best.short}"
        if best.partitions:  # the greedy plan, not the solver's
            _say(f"autodist: on mesh {best.mesh_shape} {best.axis_names} {best.short}")
    return Plan(best.mesh_shape, best.axis_names, partitions, policy="autodist", note=note)


def _say(message: str) -> None:
    """A :class:`PlanWarning`, once per job (every rank plans alike): on rank 0 or without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        warnings.warn(message, PlanWarning, stacklevel=4)


def built_in_fallback(graph: IRGraph, config: ComputeConfig, sols: list[Solution]) -> Plan | None:
    """Where no mesh has a plan: the faster of the ``dp`` and ``tp`` plans whose estimated peak per rank
    (:func:`nnscaler.cost.estimate.analyze`, what the plan report shows) fits ``config.mem_budget``, as
    autodist's plan with a note and a :class:`PlanWarning` saying why; ``None`` where neither plans and fits
    (the search's own error stands). The program's memory model may be stricter than the estimate, and
    HiGHS may stop on every mesh: a model that ``dp`` or ``tp`` plans never ends in :class:`PlanError`."""
    from ..cost.estimate import analyze  # the estimate emits the program: only on this path
    from .builtin import dp, tp
    profile = get_profile(config.profile)
    found = []
    for name, policy in (("dp", dp), ("tp", tp)):
        try:
            plan = policy(graph, config)
            validate(plan, graph, config)
            stats = analyze(graph, plan, profile)
        except PlanError:
            continue
        peak = max(stats.peak_bytes, default=0)
        if config.mem_budget is None or peak <= config.mem_budget:
            found.append((stats.step_seconds, name, plan, peak))
    if not found:
        return None
    step, name, plan, peak = min(found, key=lambda f: f[0])
    searched = "; ".join(f"{s.mesh_shape}{'x'.join(s.axis_names)}: {s.status} ({s.size()})" for s in sols)
    why = ("HiGHS stopped short of optimal without a plan on every mesh" if any(s.stopped for s in sols)
           else "the integer program found no plan within the budget")
    note = (f"autodist ({profile.name}, budget {human(config.mem_budget) if config.mem_budget else 'none'}): {why} "
            f"(searched {searched}); fell back to the {name} plan ({seconds(step)}, {human(peak)}/rank by the estimate)")
    _say(f"autodist: {why}; fell back to the {name} plan ({human(peak)}/rank)")
    return Plan(plan.mesh_shape, plan.axis_names, dict(plan.partitions), policy="autodist", note=note)


def short_of_optimal(graph: IRGraph, prog: Program, sol: Solution, batch, budget: float | None) -> Solution:
    """The plan of a mesh where HiGHS stopped without one (:attr:`Solution.stopped`): the greedy plan on
    that mesh with autodist's axis options, costed by the mesh's program, when it fits ``budget``;
    ``sol`` itself (no plan) when it does not. ``short`` says which and why."""
    why = f"HiGHS stopped short of optimal without a usable plan (status {sol.status!r})"
    greedy = plan_greedy(graph, sol.mesh_shape, sol.axis_names, axis_options(sol.axis_names, batch), "autodist")
    try:
        choice = [k.cands.index(greedy.partition(k.ops[0])) for k in prog.classes]
    except ValueError:  # a greedy partition outside the program's candidates: not costed, so not compared
        choice = None
    seconds_, memory = prog.evaluate(choice) if choice is not None else (math.inf, math.inf)
    if choice is None or (budget is not None and memory > budget):
        sol.status = f"{sol.status}; greedy plan " + ("not costed" if choice is None else f"over budget ({human(memory)})")
        return sol
    return Solution(sol.mesh_shape, sol.axis_names, f"greedy ({sol.status})", choice, seconds_, memory,
                    sol.variables, sol.constraints, sol.solve_seconds,
                    short=f"{why}: the greedy plan on this mesh instead", partitions=dict(greedy.partitions))


def _search(progs: list[Program], budget: float | None, time_limit: float = TIME_LIMIT,
            nodes: int = MIP_NODES) -> list[Solution]:
    """Every mesh's best plan, or why it has none. Meshes are solved in order of their linear
    relaxation's bound, each with the best plan so far as a cutoff: a mesh whose bound cannot beat it
    is not branched on (on a tight budget, proving a poor mesh optimal took HiGHS most of the search).
    A mesh where HiGHS stopped short keeps its status (:attr:`Solution.stopped`)."""
    bounds = [solve(p, budget, time_limit, relax=True, nodes=nodes) for p in progs]
    sols: list[Solution] = [None] * len(progs)  # type: ignore[list-item]
    best: Solution | None = None
    for i in sorted(range(len(progs)), key=lambda i: bounds[i].seconds):
        b = bounds[i]
        if b.seconds == math.inf:
            sols[i] = Solution(b.mesh_shape, b.axis_names, "infeasible", variables=b.variables,
                               constraints=b.constraints, solve_seconds=b.solve_seconds)
            continue
        if best is not None and b.seconds >= best.seconds:
            sols[i] = Solution(b.mesh_shape, b.axis_names, f"no faster plan (bound {seconds(b.seconds)})",
                               variables=b.variables, constraints=b.constraints, solve_seconds=b.solve_seconds)
            continue
        sol = solve(progs[i], budget, time_limit, cutoff=best.seconds if best is not None else None, nodes=nodes)
        sol.solve_seconds += b.solve_seconds
        if sol.choice is None and sol.status.startswith(PROVEN):
            sol.status = ("infeasible" if best is None or sol.status.lower() == "infeasible"
                          else f"no faster plan (bound {seconds(b.seconds)})")
        sols[i] = sol
        if sol.choice is not None and (best is None or sol.seconds < best.seconds):
            best = sol
    return sols
