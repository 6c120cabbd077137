"""A plan's summary (a dict), its report (tables) and its one-line form, from its :class:`PlanStats`
(``Plan.summary()`` and the others reach these through ``plan.stats``)."""
from __future__ import annotations

from collections import Counter, defaultdict

from tabulate import tabulate

REASONS = {  # why an operator stays whole (nnscaler.policies.coverage), as the reports say it
    "unknown": "no annotation: no rule to split it",
    "indivisible": "no splittable dim divides the mesh",
    "whole": "kept whole by the policy: cheaper whole on this profile, or not a dim it splits",
}


def human(n: float) -> str:
    """``1.5 GiB``-style bytes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def collective_table(stats) -> dict[str, dict[str, dict[str, int]]]:
    """phase -> kind -> {count, bytes} per rank per training step."""
    out: dict = defaultdict(lambda: defaultdict(lambda: {"count": 0, "bytes": 0, "seconds": 0.0}))
    for c in stats.collectives:
        row = out[c.phase][c.kind]
        row["count"] += 1
        row["bytes"] += c.nbytes
        row["seconds"] += c.seconds
    return {phase: dict(kinds) for phase, kinds in out.items()}


def param_fraction(stats) -> float:
    """The largest share of the model's parameters one rank holds."""
    whole = stats.single_device["param"]
    return max(stats.param_bytes) / whole if whole else 0.0


def summary(plan, s) -> dict:
    return {
        "policy": plan.policy, "mesh_shape": list(plan.mesh_shape), "axis_names": list(plan.axis_names),
        "world_size": plan.world_size, "profile": s.profile,
        "memory_per_rank": {"params": s.param_bytes, "grads": s.grad_bytes, "optimizer": s.optim_bytes,
                            "buffers": s.buffer_bytes, "activations": s.activation_bytes, "peak": s.peak_bytes},
        "memory_one_device": {**s.single_device, "peak": sum(s.single_device.values())},
        "param_fraction_per_rank": param_fraction(s),
        "sharded": [{"name": n, "shape": list(shape), "layout": lay} for n, shape, lay in s.sharded],
        "replicated_params": s.replicated_params,
        "zero": {"stage": s.zero, "ranks": s.zero_ranks},
        "collectives": collective_table(s),
        "step_time": {"compute_s": s.compute_seconds, "comm_s": s.comm_seconds, "total_s": s.step_seconds},
        "replicated_operators": {"count": len(s.replicated_ops),
                                 "ops": [{"name": n, "overload": o, "why": w} for n, o, w in s.replicated_ops]},
        "inferred_annotations": [{"operator": n, "annotation": a} for n, a in getattr(s, "inferred", [])],
        "data_dependent_guards": list(getattr(s, "guards", [])),
        "respecialised": list(getattr(s, "respecialised", [])),
        "note": plan.note,
    }


LISTED = 10  # overloads named in a one-line summary


def replicated_listing(replicated_ops) -> str:
    """``overload xK (reason), ...`` of ``(name, overload, reason)`` triples, the most frequent first."""
    kinds = Counter((o.removeprefix("aten."), why) for _, o, why in replicated_ops).most_common()
    listing = ", ".join(f"{o} x{n}" + (f" ({REASONS[why].split(':')[0]})" if why != "whole" else "")
                        for (o, why), n in kinds[:LISTED])
    return listing + (f", {len(kinds) - LISTED} more kinds" if len(kinds) > LISTED else "")


def zero_sharded(s) -> str:
    """What ZeRO stage ``s.zero`` shards: the optimizer state, the gradients too, the parameters too."""
    return ("the AdamW state", "the AdamW state and gradients", "the AdamW state, gradients and parameters")[
        min(s.zero, 3) - 1]


def one_line(plan, s) -> str:
    table = collective_table(s)
    count = {p: sum(k["count"] for k in table.get(p, {}).values()) for p in ("forward", "backward", "grad sync")}
    coupled = sum(c.coupled and c.phase == "forward" for c in s.collectives)  # inside operators (batch norm)
    count["forward"] = f"{count['forward'] - coupled}" + (f" (+{coupled} coupled)" if coupled else "")
    moved = sum(c.nbytes for c in s.collectives)
    return (f"plan {plan.policy or 'custom'} on mesh {plan.mesh_shape} {plan.axis_names}: params "
            f"{100 * param_fraction(s):.0f}% per rank ({human(max(s.param_bytes))} of "
            f"{human(s.single_device['param'])}), peak {human(max(s.peak_bytes))}/rank, collectives "
            f"{count['forward']} fwd + {count['backward']} bwd + {count['grad sync']} grad sync "
            f"({human(moved)}), est. step {seconds(s.step_seconds)} on {s.profile}, "
            + (f"zero {s.zero} over {s.zero_ranks} ranks, " if s.zero and s.zero_ranks > 1 else "")
            + f"{len(s.replicated_ops)} ops replicated"
            + (f": {replicated_listing(s.replicated_ops)}" if s.replicated_ops else "")
            + (f"; traced for the sample's data-dependent branch or size at {len(s.guards)} lines, checked at run "
               f"time: {'; '.join(s.guards)}" if getattr(s, "guards", None) else ""))


def report(plan, s) -> str:
    w = plan.world_size
    ranks = list(range(w)) if w <= 8 else [0, w - 1]
    mem_rows = []
    for label, per_rank, one in (("parameters", s.param_bytes, s.single_device["param"]),
                                 ("gradients", s.grad_bytes, s.single_device["grad"]),
                                 ("AdamW state", s.optim_bytes, s.single_device["optim"]),
                                 ("buffers", s.buffer_bytes, s.single_device["buffer"]),
                                 ("activations (saved)", s.activation_bytes, s.single_device["activation"]),
                                 ("peak", s.peak_bytes, sum(s.single_device.values()))):
        mem_rows.append([label, *(human(per_rank[r]) for r in ranks), human(one)])
    parts = [one_line(plan, s), "",
             f"memory per rank (cost model, profile {s.profile}):",
             tabulate(mem_rows, ["", *(f"rank {r}" for r in ranks), "one device"]), ""]
    coll_rows = [[phase, kind, v["count"], human(v["bytes"]), seconds(v["seconds"])]
                 for phase, kinds in collective_table(s).items() for kind, v in kinds.items()]
    parts += ["collectives per training step (one rank):",
              tabulate(coll_rows, ["phase", "kind", "count", "bytes", "est. time"]) if coll_rows else "  none", "",
              f"estimated step time: {seconds(s.step_seconds)} = compute {seconds(s.compute_seconds)} + "
              f"communication {seconds(s.comm_seconds)} (no overlap assumed)", "",
              f"sharded state ({len(s.sharded)} tensors; {s.replicated_params} parameters whole on every rank):"
              if not (s.zero and s.zero_ranks > 1) else
              f"sharded state ({len(s.sharded)} tensors split by the layout; {s.replicated_params} parameters whole "
              f"in it, of which ZeRO {s.zero} shards {zero_sharded(s)} over {s.zero_ranks} data-parallel ranks):"]
    parts += [tabulate([[n, "x".join(map(str, shape)), lay] for n, shape, lay in s.sharded],
                       ["tensor", "shape", "layout per mesh axis"]) if s.sharded else "  none", ""]
    by_kind: dict = defaultdict(list)
    for name, overload, why in s.replicated_ops:
        by_kind[(overload, why)].append(name)
    parts.append(f"replicated operators: {len(s.replicated_ops)}")
    parts += [f"  {o} x{len(names)} ({REASONS.get(why, why)}): {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
              for (o, why), names in by_kind.items()]
    if getattr(s, "guards", None):
        parts += ["", f"data-dependent branches and sizes traced for the sample input, checked at run time: {len(s.guards)}"]
        parts += [f"  {line}" for line in s.guards]
    if getattr(s, "respecialised", None):
        parts += ["", f"programs respecialised at run time, a guard on the model's state having failed: "
                      f"{len(s.respecialised)} (this program is the last; each is kept for its branch)"]
        parts += [f"  {line}" for line in s.respecialised]
    if plan.over_replicas:  # nnscaler/compile/writes.py: a buffer written from the batch under replicas
        parts += ["", f"operators run over every one of the {plan.replicas} data-parallel replicas' rows (a buffer is "
                      f"written from the batch; each gathers the rows, one all-gather per call, not in the "
                      f"collectives above): {len(plan.over_replicas)}"]
        parts += [f"  {n} (batch {i})" for n, i in plan.over_replicas.items()]
    inferred = getattr(s, "inferred", [])
    if inferred:
        parts += ["", f"annotations inferred by probing (no rule; verified like every plan by the harness): {len(inferred)}"]
        parts += [f"  {n}: {a}" for n, a in inferred]
    causes = s.causes() if getattr(s, "causes", None) is not None and w > 1 else []
    if causes:  # nnscaler/cost/causes.py: why each forward collective, one line per cause
        parts += ["", "forward collectives by cause (plan rank 0; those Megatron's plan also issues last):"]
        parts += [f"  {c}" for c in causes]
    if plan.note:
        parts += ["", plan.note]
    return "\n".join(parts) + "\n"
