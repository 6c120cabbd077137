"""Why a plan's program issues each forward collective: one line per cause (the operator that reads the
converted tensor, the operator that made it, and the reason), for the plan report. Megatron's own
collectives (a row-parallel output summed, the vocabulary-parallel embedding and loss) are told apart
from the others, so a tp plan over Megatron's bar (at most 2 per layer plus 4) says where the rest go."""
from __future__ import annotations

import math
from collections import Counter

from ..codegen.emit import emit_program
from ..dimops.layout import Partial, Shard
from ..ir.graph import PARAM, IRGraph, IROp, IRTensor

FORWARD = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_sum_grad"}
NORMS = ("layer_norm", "group_norm", "rms_norm", "batch_norm")
STATISTICS = ("mean", "var", "sum", "std", "amax", "max", "logsumexp", "norm")
MEGATRON = "Megatron's"  # the reasons that open with this word are collectives Megatron's plan issues too


def _weight_matrix(op: IROp | None) -> bool:
    return op is not None and any(isinstance(x, IRTensor) and x.kind == PARAM and len(x.shape) >= 2 for x in op.inputs)


def _name(op: IROp | None) -> str:
    return "output" if op is None else op.overload.removeprefix("aten.").removesuffix(".default")


def _line(op: IROp | None) -> str:
    src = (op.source or "").strip().splitlines() if op is not None else []
    return f" ({src[0].rsplit('/', 1)[-1][:100]})" if src else ""


def reason(t: IRTensor, before, step, reader: IROp | None) -> str:
    """The reason one forward collective is issued: ``t`` (in layout ``before``) moved by ``step``
    for ``reader`` (``None``: the program's output)."""
    prod = t.producer
    kind = step.kind.replace("all_gather_sum_grad", "all_gather")
    pname = _name(prod) if prod is not None else t.kind
    q = before[step.axis] if step.axis < len(before) else None
    if prod is not None and prod.overload == "aten.embedding.default" and kind == "all_reduce":
        return f"{MEGATRON} vocabulary-parallel embedding: its partial rows summed"
    if reader is None:
        return f"{MEGATRON} output made whole: {kind} of {pname} (the loss's partial sums)"
    if reader.overload.startswith(("aten.cross_entropy", "aten.nll_loss")):
        return f"{MEGATRON} loss over split classes: {kind} of {pname}"
    if kind == "all_reduce" and isinstance(q, Partial):
        if any(s in pname for s in STATISTICS) and t.shape and t.shape[-1] == 1:
            return (f"norm over a split hidden dim: its statistics ({pname}, {math.prod(t.shape)} elements) "
                    f"all-reduced rather than the activations gathered")
        if _weight_matrix(prod):
            return f"{MEGATRON} row-parallel {pname}: its partial output summed"
        return f"{pname} contracts a split dim: its partial output summed"
    if kind == "all_gather":
        what = "the whole of its split output"
        if any(n in _name(reader) for n in NORMS) or (reader and "rsqrt" in (reader.source or "")):
            return f"a norm ({_name(reader)}) over {pname}'s split dim: {what} gathered"
        if _weight_matrix(prod):
            return f"column-split {pname} read whole by {_name(reader)}: {what} gathered"
        return f"{_name(reader)} reads {pname} whole: {what} gathered"
    if kind == "all_to_all":
        dim = f" dim {q.dim}" if isinstance(q, Shard) else ""
        return f"{_name(reader)} reads {pname} split on another dim than{dim}: re-laid out by all-to-all"
    return f"{_name(reader)} reads {pname}: {kind}"


def forward_causes(graph: IRGraph, plan, rank: int = 0) -> list[str]:
    """One line per cause of plan rank ``rank``'s forward collectives on activations (parameters'
    gathers left out, as :func:`nnscaler.policies.tp_check.collectives` counts with ``params=False``):
    ``N x <kind> for <reader> of <producer>: <reason> (<the reader's first source line>)``, the causes
    Megatron's plan shares last."""
    e = emit_program(graph, plan, rank)
    params = set(graph.params)
    count: Counter = Counter()
    first: dict = {}
    for (t, before, step), reader in zip(e.steps, e.readers):
        if step.kind not in FORWARD or t in params or step.coalesced:  # summed in an earlier step's collective
            continue
        key = (step.kind.replace("all_gather_sum_grad", "all_gather"), reason(t, before, step, reader))
        count[key] += 1
        first.setdefault(key, reader)
    order = sorted(count, key=lambda k: (k[1].startswith(MEGATRON), -count[k]))
    return [f"{count[k]} x {k[0]}: {k[1]}{_line(first[k])}" for k in order]
