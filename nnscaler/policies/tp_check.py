"""What a tensor-parallel plan costs, counted from the program the compiler emits: collectives per
training step (forward and backward, by kind) and how much of a set of parameters is stored split.
The ``tp`` tests and ``bench/studies/tp_collectives.py`` judge plans against Megatron-LM with these."""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import Callable

from ..codegen.emit import conversion_steps, stored_layouts
from ..cost.steps import coupled_splits
from ..dimops.layout import Shard
from ..ir.graph import IRGraph
from ..ir.plan import Plan

FORWARD = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_sum_grad"}
# the collective each step's backward issues (for tensors that carry a gradient)
BACKWARD = {"grad_all_reduce": "all_reduce", "split": "all_gather", "reduce_scatter": "all_gather",
            "all_to_all": "all_to_all", "all_gather_sum_grad": "reduce_scatter"}
_RENAME = {"all_gather_sum_grad": "all_gather"}


def collectives(graph: IRGraph, plan: Plan, rank: int = 0, params: bool = True) -> tuple[Counter, Counter]:
    """(forward, backward) collectives of one training step on plan rank ``rank``, by kind;
    ``params=False`` leaves out those on parameters (gradient sums of weights kept whole, such as a
    sequence-parallel norm's over both axes of a dp x tp mesh)."""
    fwd, bwd = Counter(), Counter()
    keep = None if params else {t for t in graph.params}
    for step, grad, t in conversion_steps(graph, plan, rank, tensors=True):
        if keep is not None and t in keep or step.coalesced:  # summed in an earlier step's one collective
            continue
        if step.kind in FORWARD:
            fwd[_RENAME.get(step.kind, step.kind)] += 1
        if grad and step.kind in BACKWARD:
            bwd[BACKWARD[step.kind]] += 1
    return fwd, bwd


def coupled_collectives(graph: IRGraph, plan: Plan) -> int:
    """Forward collectives that operators issue inside their own kernels because the plan splits an
    identifier their spec declares ``coupled`` (batch statistics: one per batch norm under dp; each
    has one in the backward too). These are not layout conversions, so :func:`collectives` leaves
    them out; a plan report counts them apart, as batch-coupled."""
    return len({op.name for op, _, _ in coupled_splits(graph, plan)})


# a list of layers: h.3, layers.3, layer.3, block.3, blocks.3, and prefixed ones (ALBERT's albert_layers.0)
LAYER = re.compile(r"\.(h|\w*layers?|\w*blocks?)\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The transformer layer a parameter belongs to (``h.3.attn...`` -> 3), if any."""
    m = LAYER.search("." + name)
    return int(m.group(2)) if m else None


SIBLING = re.compile(r"\.(\w+)\.(\d+)\.")  # any list of modules: XLM's attentions.3, ffns.3, layer_norm1.3


def layer_paths(names: list[str]) -> dict[str, str | None]:
    """Per parameter name, the path of the transformer layer it belongs to (``....layers.3.``), if any.
    A model with no list of layers whose layer is split over sibling lists, one per component, all of
    one length (XLM, FlauBERT: ``attentions.i``, ``layer_norm1.i``, ``ffns.i``, ``layer_norm2.i``) has
    layer ``i`` in each: its path is the parent's with ``#i``."""
    out = {}
    for n in names:
        m = LAYER.search("." + n)
        out[n] = m.string[:m.end()] if m else None
    if any(out.values()):
        return out
    lists: dict[str, dict[str, set[str]]] = {}  # parent -> list -> its indices
    for n in names:
        m = SIBLING.search("." + n)
        if m:
            lists.setdefault(m.string[:m.start()], {}).setdefault(m.group(1), set()).add(m.group(2))
    per = {p: ls for p, ls in lists.items() if len(ls) >= 2 and len({frozenset(i) for i in ls.values()}) == 1
           and len(next(iter(ls.values()))) >= 2}
    for n in names:
        m = SIBLING.search("." + n)
        if m and m.string[:m.start()] in per:
            out[n] = f"{m.string[:m.start()]}.#{m.group(2)}."
    return out


def layer_runs(graph: IRGraph) -> int:
    """Layers the model runs: a layer counted as often as each of its parameters is read (the fewest
    readers among them: a weight also read by a dtype assert does not count twice). ALBERT's one
    shared layer, read by every layer: one set of weights, ``num_hidden_layers`` runs."""
    runs: dict[str, int] = {}
    readers = Counter(id(t) for op in graph.ops for t in {id(x): x for x in op.tensor_inputs()}.values())
    paths = layer_paths([t.target or t.name for t in graph.params])
    for t in graph.params:
        i = paths[t.target or t.name]  # the layer's path: an encoder's blocks.0 is not a decoder's layers.0
        if i and readers[id(t)]:
            runs[i] = min(runs.get(i, readers[id(t)]), readers[id(t)])
    return sum(runs.values())


def sharded_fraction(graph: IRGraph, plan: Plan, select: Callable[[str], bool] | None = None) -> tuple[float, float]:
    """Of the parameters whose name ``select`` accepts (default: those inside transformer layers,
    :func:`layer_paths`): (fraction of their elements stored split, fraction of their bytes each rank holds)."""
    if select is None:
        paths = layer_paths([t.target or t.name for t in graph.params])
        select = lambda n: paths.get(n) is not None  # noqa: E731
    stored = stored_layouts(graph, plan)
    total = split = held = 0
    for t in graph.params:
        if not select(t.target or t.name):
            continue
        n = math.prod(t.shape)
        lay = stored.get(t, ())
        cut = math.prod(f for f, q in zip(plan.mesh_shape, lay) if isinstance(q, Shard))
        total += n
        split += n if cut > 1 else 0
        held += n / cut
    return (split / total, held / total) if total else (0.0, 1.0)
