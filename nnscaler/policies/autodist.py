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
from dataclasses import dataclass

import highspy
import numpy as np

from ..cost.compute import op_flops
from ..profiles import get_profile
from ..dimops.partition import splittable
from ..ir.graph import IRGraph, IROp
from .autodist_program import Program, Shared, build_program, op_classes
from .builtin import batch_identifiers
from .greedy import candidates, fused_blocks
from ..config import ComputeConfig, PlanError
from ..cost.summary import human, seconds
from ..ir.plan import Plan

# Every rank runs the search and must reach the same plan, so the search is bounded by work (branch-
# and-bound nodes; HiGHS is deterministic on one thread), not by the clock; the time limit is only a
# fail-safe, and hitting it is an error naming the solver's status rather than a plan that may differ.
MIP_NODES = 2000
TIME_LIMIT = 120.0  # seconds per mesh
_MS = 1e3  # the objective in milliseconds keeps HiGHS's tolerances meaningful
MIP_GAP = 0.005  # stop within 0.5% of the best bound: the cost model is not finer than that


@dataclass
class Solution:
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    status: str
    choice: list[int] | None = None  # candidate index per class
    seconds: float = math.inf
    memory: float = math.inf


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
          relax: bool = False, cutoff: float | None = None) -> Solution:
    """Solve one mesh's program with HiGHS (minimum step time under ``budget``, or minimum memory).
    ``relax``: only the linear relaxation (its ``seconds`` bound every plan on the mesh from below,
    ``choice`` stays None); ``cutoff``: seconds of a plan already found (the search proves this mesh
    cannot beat it, or finds one that does; status ``Objective bound`` when it cannot)."""
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
    h.setOptionValue("time_limit", max(1e-3, time_limit))
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", MIP_GAP)
    h.setOptionValue("mip_max_nodes", MIP_NODES)
    if cutoff is not None and not relax:
        h.setOptionValue("objective_bound", (cutoff - prog.fixed_seconds) * _MS)
    costs = np.concatenate([cost, *pair_costs]) if pair_costs else cost
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
    h.run()
    status = h.getModelStatus()
    text = h.modelStatusToString(status)
    has_solution = h.getInfo().primal_solution_status == 2
    sol = Solution(prog.mesh_shape, prog.axis_names, text)
    if status == highspy.HighsModelStatus.kInfeasible or (
            status == highspy.HighsModelStatus.kObjectiveBound and not has_solution):
        return sol
    if relax and status == highspy.HighsModelStatus.kOptimal:
        sol.seconds = prog.fixed_seconds + h.getInfo().objective_function_value / _MS
        return sol
    if status == highspy.HighsModelStatus.kTimeLimit or (status != highspy.HighsModelStatus.kOptimal
                                                         and not has_solution):
        raise PlanError(f"autodist: HiGHS stopped without a plan on mesh {prog.mesh_shape}: status {text!r}")
    x = np.array(h.getSolution().col_value[:nx])
    sol.choice = [int(np.argmax(x[offset[k]:offset[k] + len(c.cands)])) for k, c in enumerate(classes)]
    sol.seconds, sol.memory = prog.evaluate(sol.choice)
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
    known = [op for op in graph.ops if op.known]
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


def autodist(graph: IRGraph, config: ComputeConfig) -> Plan:
    """Search meshes and partitions for the fastest plan (by the cost model of ``config.profile``)
    whose estimated peak memory per rank fits ``config.mem_budget``."""
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
    sols = _search(progs, config.mem_budget)
    fits = [s for s in sols if s.choice is not None]
    if not fits:
        least = min((solve(p, None, TIME_LIMIT, minimize_memory=True) for p in progs),
                    key=lambda s: s.memory)
        raise PlanError(f"autodist: no plan on {world} ranks fits mem_budget={human(config.mem_budget)} per rank "
                        f"(profile {profile.name}); the smallest per-rank memory reachable is {human(least.memory)} "
                        f"(mesh {least.mesh_shape} {least.axis_names}): raise mem_budget to at least that, or plan "
                        f"for more ranks")
    best_i = min(range(len(sols)), key=lambda i: sols[i].seconds if sols[i].choice is not None else math.inf)
    best, prog = sols[best_i], progs[best_i]
    partitions = {op.name: k.cands[c] for k, c in zip(prog.classes, best.choice) for op in k.ops}
    tried = "; ".join(f"{s.mesh_shape}{'x'.join(s.axis_names)}: "
                      + (f"{seconds(s.seconds)}, {human(s.memory)}/rank" if s.choice is not None else s.status)
                      for s in sols)
    note = (f"autodist ({profile.name}, budget {human(config.mem_budget) if config.mem_budget else 'none'}, "
            f"{len(classes)} operator classes, {time.perf_counter() - start:.1f} s): chose mesh {best.mesh_shape} "
            f"{best.axis_names}; searched {tried}")
    return Plan(best.mesh_shape, best.axis_names, partitions, policy="autodist", note=note)


def _search(progs: list[Program], budget: float | None) -> list[Solution]:
    """Every mesh's best plan, or why it has none. Meshes are solved in order of their linear
    relaxation's bound, each with the best plan so far as a cutoff: a mesh whose bound cannot beat it
    is not branched on (on a tight budget, proving a poor mesh optimal took HiGHS most of the search)."""
    bounds = [solve(p, budget, TIME_LIMIT, relax=True) for p in progs]
    sols: list[Solution] = [None] * len(progs)  # type: ignore[list-item]
    best: Solution | None = None
    for i in sorted(range(len(progs)), key=lambda i: bounds[i].seconds):
        b = bounds[i]
        if b.seconds == math.inf:
            sols[i] = Solution(b.mesh_shape, b.axis_names, "infeasible")
            continue
        if best is not None and b.seconds >= best.seconds:
            sols[i] = Solution(b.mesh_shape, b.axis_names, f"no faster plan (bound {seconds(b.seconds)})")
            continue
        sol = solve(progs[i], budget, TIME_LIMIT, cutoff=best.seconds if best is not None else None)
        if sol.choice is None:
            sol.status = ("infeasible" if best is None or sol.status.lower() == "infeasible"
                          else f"no faster plan (bound {seconds(b.seconds)})")
        sols[i] = sol
        if sol.choice is not None and (best is None or sol.seconds < best.seconds):
            best = sol
    return sols
