"""The built-in policies: ``dp``, ``tp``, ``cp``, ``hybrid``, ``hybrid_cp``, ``random`` and ``random2d``; each is
``(graph, config) -> Plan``."""
from __future__ import annotations

import random as _random

from ..dimops.partition import prefix_size, split_factor, splittable
from ..ir.graph import INPUT, PARAM, IRGraph, IROp, IRTensor
from .heads import pin_heads, scores
from .lone import DENSE, lone_columns
from .greedy import held_blocks, parameter_identifiers, plan_greedy, sharded_identifiers
from .refine import refine
from .masks import rows_per_chunk
from ..config import ComputeConfig, PlanError
from ..ir.plan import Plan


def batch_identifiers(graph: IRGraph, dim: int = 0) -> dict[str, str | None]:
    """Per operator, the identifier that carries the batch (dim ``dim`` of the user inputs; 1: the
    sequence of token inputs), if any. The batch is followed through merges: in ``(s b)`` (rows of
    sequence x batch) it is ``b``, and an operator reading those rows whole splits them in ``s``
    blocks (the greedy follows the blocks its input holds)."""
    return batch_rows(graph, dim)[0]


def batch_rows(graph: IRGraph, dim: int = 0) -> tuple[dict[str, str | None], dict[IRTensor, tuple[int, int]]]:
    """:func:`batch_identifiers`, and the tensors that carry the batch: each with the dim it lies in and
    the blocks it is cut in there (1: the batch is that dim's outermost factor)."""
    where: dict[IRTensor, tuple[int, int]] = {t: (dim, 1) for t in graph.inputs if t.kind == INPUT and len(t.shape) > dim}
    out: dict[str, str | None] = {}
    for op in graph.ops:
        ident, blocks = None, 1
        if op.known:
            for x, dims in zip(op.inputs, op.bound.inputs):
                if isinstance(x, IRTensor) and x in where and dims is not None:
                    d, blocks = where[x]
                    ident = split_factor(dims[d], blocks, op.bound)
                    blocks = blocks if len(dims[d]) == 1 else 1
                    break
            if ident is not None:
                for t, dims in zip(op.outputs, op.bound.outputs):
                    for d, ids in enumerate(dims or ()) if t is not None else ():
                        if ident in ids:
                            j = ids.index(ident)
                            where[t] = (d, prefix_size(ids, j, op.bound) or 1 if j else blocks)
                            break
        out[op.name] = ident
    return out, where


def check_batch_divisible(graph: IRGraph, ranks: int, policy: str) -> None:
    """Refuse a data-parallel axis of ``ranks`` that does not divide the batch (dim 0 of the first
    batched input): every batch operator would stay whole on every rank, a plan that matches the
    model and parallelizes nothing."""
    first = next((t for t in graph.inputs if t.kind == INPUT and len(t.shape) > 0), None)
    if ranks > 1 and first is not None and first.shape[0] % ranks:
        n = first.shape[0]
        near = sorted({m for m in ((n // ranks) * ranks, (n // ranks + 1) * ranks) if m > 0})
        raise PlanError(f"{policy}: the batch ({n} rows, dim 0 of input {first.name!r}) does not divide over {ranks} "
                        f"data-parallel ranks, so no batch operator could be split; use a batch that is a multiple "
                        f"of {ranks} ({' or '.join(map(str, near))}), or another policy (tp)")


def _dp_options(graph: IRGraph):
    batch = batch_identifiers(graph)
    return lambda op, axis, layouts: [batch[op.name]] if batch[op.name] is not None else [None]


def _tp_options(graph: IRGraph, sequence_parallel: bool = False):
    """Megatron's choices: split a dim of the op's parameters, or follow a split its inputs already
    have; never the batch (that is data parallelism). With ``sequence_parallel``, operators without
    a weight matrix (norms, dropout, residual adds) may also split the sequence. A column split with no
    row partner is never offered (:mod:`nnscaler.policies.lone`)."""
    batch = batch_identifiers(graph)
    seq = batch_identifiers(graph, 1) if sequence_parallel else {}
    small = _small_weight_math(graph) | _table_projections(graph)
    lone = lone_columns(graph)

    def options(op: IROp, axis: int, layouts: dict):
        if op.name in small:
            return [None]
        ids = _megatron(op, axis, layouts)
        s = seq.get(op.name)
        if s is not None and s != batch[op.name] and no_weight_matrix(op):
            # split, never whole: the sequence, or a split its inputs already have (heads)
            return [s, *(i for i in ids if i not in (None, s))]
        return ids

    def _megatron(op: IROp, axis: int, layouts: dict):
        if op.overload == "aten.cross_entropy_loss.default" or (
                op.overload == "aten.embedding.default" and _looks_up_inputs(op)):
            return [_vocab(op)]
        if op.overload == "aten.embedding.default":  # positions, token types: small, replicated
            return [None]
        params, held = set(parameter_identifiers(op)), set(sharded_identifiers(op, axis, layouts))
        allowed = held if no_weight_matrix(op) else params | held  # a norm's, a bias's, a scale's vector follows
        # the sequence splits no weight matrix's work; an identifier that also splits a parameter
        # (experts, which opzoo.moe.experts ties to the tokens) is model parallelism, not the batch; nor
        # is a batch dim its inputs hold split in blocks (heads merged into the batch, ``(b h)``)
        never = {batch[op.name], seq.get(op.name)} - params - set(held_blocks(op, layouts))
        never |= _megatron_pairs(op, params, held) | lone.get(op.name, set())
        return [None, *(i for i in splittable(op.bound) if i in allowed and i not in never)]

    return options


def _megatron_pairs(op: IROp, params: set[str], held: set[str]) -> set[str]:
    """Megatron's column-then-row pairing of a weight matrix with the activation it reads, as the
    identifiers it may not split: fed whole, it splits its outputs (column-parallel), never the dim
    it contracts with the activation; fed split on that dim, it contracts it split (row-parallel),
    never gathering its input to split its outputs. A row split of a whole input all-reduces its
    output and gathers its input's gradient, two collectives where the column split needs one (a
    shared expert narrower than the hidden size took two all-reduces per layer); a column split of
    a split input gathers it, and its output too where the residual stream needs it whole."""
    if no_weight_matrix(op):
        return set()
    out = {i for dims in op.bound.outputs if dims for ids in dims for i in ids}
    act = {i for x, dims in zip(op.inputs, op.bound.inputs)
           if isinstance(x, IRTensor) and x.kind != PARAM and dims for ids in dims for i in ids}
    contracted = {i for i in params if i not in out and i in act}
    if contracted & held:
        return {i for i in params if i in out and i not in held}
    return contracted - held


def _small_weight_math(graph: IRGraph) -> set[str]:
    """Operators computing on parameters alone with no weight matrix among them (``1 + w`` of a
    Gemma norm, ``w.float()`` of a bias, a bias picked per token: :func:`_picked_bias`): Megatron keeps norms and biases whole, so these stay whole
    too. Split, they are free where they run but need an all-gather where their whole-tensor consumer
    (the norm's multiply) reads them: a collective per norm that a myopic choice cannot see."""
    derived: set[int] = set()
    out: set[str] = set()
    for op in graph.ops:
        ins = op.tensor_inputs()
        if ins and (all(t.kind == PARAM and len(t.shape) < 2 or id(t) in derived for t in ins) or _picked_bias(op, ins)):
            out.add(op.name)
            derived.update(id(t) for t in op.outputs)
    return out


def _table_projections(graph: IRGraph) -> set[str]:
    """Weight-matrix operators none of whose inputs is computed from a model input: a projection of a
    fixed table (Swin-V2's continuous position bias MLP over its coordinate grid), the same on every
    rank whatever the batch. Megatron keeps such a table's MLP whole; split by columns, its output
    was gathered for a second projection that split the heads (an all-gather per layer)."""
    streamed: set[int] = {id(t) for t in graph.inputs if t.kind == INPUT}
    out: set[str] = set()
    for op in graph.ops:
        if any(id(t) in streamed for t in op.tensor_inputs()):
            streamed.update(id(t) for t in op.outputs if t is not None)
        elif op.overload in DENSE and not no_weight_matrix(op):
            out.add(op.name)
    return out


def _picked_bias(op: IROp, ins: list[IRTensor]) -> bool:
    """A bias per row of a 2-d parameter picked by integer indices (``b[expert_ids]``: each
    token's expert's bias): a vector per token, whole as Megatron keeps biases. Split, it splits the
    hidden dim of a row-parallel output it is added to (a reduce-scatter there, and the residual
    stream after it split, normalised by an all-reduce and gathered back per layer)."""
    return (op.overload == "aten.index.Tensor" and ins[0].kind == PARAM and len(ins[0].shape) == 2
            and all(not t.dtype.is_floating_point for t in ins[1:]))


def no_weight_matrix(op: IROp) -> bool:
    return op.overload not in ("aten.embedding.default", "aten.cross_entropy_loss.default") and not any(
        isinstance(x, IRTensor) and x.kind == PARAM and len(x.shape) >= 2 for x in op.inputs)


def _any_options(op: IROp, axis: int, layouts: dict):
    return [None, *splittable(op.bound)]


def _looks_up_inputs(op: IROp) -> bool:
    """An embedding indexed by the user's tokens (a word embedding, split by vocabulary), not by
    positions or token types the model makes itself (those tables are small and stay whole)."""
    idx = op.inputs[1] if len(op.inputs) > 1 else None
    seen = set()
    while isinstance(idx, IRTensor) and idx.kind != INPUT and idx.producer is not None and id(idx) not in seen:
        seen.add(id(idx))  # follow reshapes of the ids back to a program input
        src = [x for x in idx.producer.tensor_inputs()]
        if len(src) != 1:
            return False
        idx = src[0]
    return isinstance(idx, IRTensor) and idx.kind == INPUT


def _vocab(op: IROp) -> str:
    """The vocabulary identifier of an embedding (rows of its weight) or cross entropy (classes)."""
    return op.bound.inputs[0][0][0] if op.overload == "aten.embedding.default" else op.bound.inputs[0][-1][0]


def dp(graph: IRGraph, config: ComputeConfig) -> Plan:
    """Data parallelism: split the batch of every operator that has one; replicate the rest
    (parameters replicated, their gradients summed across ranks)."""
    check_batch_divisible(graph, config.plan_ngpus, "dp")
    return plan_greedy(graph, (config.plan_ngpus,), ("dp",), _dp_options(graph), "dp")


def tp(graph: IRGraph, config: ComputeConfig) -> Plan:
    """Tensor parallelism, Megatron-style where the annotations allow it: each operator takes the
    split that needs the least communication from its producers' layouts (column- then row-split
    linear pairs, heads in attention, a fused qkv split by heads); the word embedding and cross
    entropy split their vocabulary; position tables, norms and biases stay whole.
    ``config.sequence_parallel`` adds Megatron's sequence parallelism. Attention the greedy left
    whole, or split with its key/value path split where Megatron keeps it whole (fewer kv heads than
    ranks), is planned again with its heads split pinned (:mod:`nnscaler.policies.heads`)."""
    options = _tp_options(graph, config.sequence_parallel)
    plan = refine(graph, plan_greedy(graph, (config.plan_ngpus,), ("tp",), options, "tp"), options)
    pins = pin_heads(graph, config.plan_ngpus, scores(graph))
    if all(_split_on(plan.partition(op)) == pins[op.name] for op in graph.ops if op.name in pins):
        return plan

    def pinned(op: IROp, axis: int, layouts: dict):  # attention by heads, carried to the projections
        return [pins[op.name]] if op.name in pins else options(op, axis, layouts)

    return refine(graph, plan_greedy(graph, (config.plan_ngpus,), ("tp",), pinned, "tp"), pinned)


def _cp_options(graph: IRGraph):
    """Context parallelism: every operator that carries the tokens' sequence (dim 1 of the user
    inputs) splits it; attention then needs its keys and values whole, which the layout conversion
    makes by all-gathering them (its backward sums their gradients back to the owning ranks)."""
    seq = batch_identifiers(graph, 1)
    return lambda op, axis, layouts: [seq[op.name]] if seq[op.name] is not None else [None]


def cp(graph: IRGraph, config: ComputeConfig) -> Plan:
    """Context parallelism (all-gather scheme, contiguous chunks): the sequence of every operator
    that has one split in ``plan_ngpus`` contiguous blocks; positions, masks and the loss follow
    from the annotations (a causal mask built from positions is sliced to the rank's queries, the
    loss reduced over every token). Keys and values are all-gathered before attention. Masks are built per
    chunk (each rank its rows: :func:`~nnscaler.policies.masks.rows_per_chunk`)."""
    check_sequence_divisible(graph, config.plan_ngpus, "cp")
    return rows_per_chunk(graph, plan_greedy(graph, (config.plan_ngpus,), ("cp",), _cp_options(graph), "cp"), 0)


def check_sequence_divisible(graph: IRGraph, ranks: int, policy: str) -> None:
    """Refuse a context-parallel axis of ``ranks`` that does not divide the sequence (dim 1 of the
    first input with two dims): nothing would be split."""
    first = next((t for t in graph.inputs if t.kind == INPUT and len(t.shape) > 1), None)
    if first is None:
        raise PlanError(f"{policy}: no input has a sequence dim (dim 1) to split")
    if ranks > 1 and first.shape[1] % ranks:
        raise PlanError(f"{policy}: the sequence ({first.shape[1]} tokens, dim 1 of input {first.name!r}) does not "
                        f"divide over {ranks} context-parallel ranks")


def _split_on(partition) -> str | None:
    """The identifier a one-axis partition splits (``None``: whole)."""
    return partition.splits[0][0] if partition.splits else None


def hybrid(graph: IRGraph, config: ComputeConfig) -> Plan:
    """dp x tp on a 2-D mesh: the outer axis splits the batch, the inner axis as ``tp``."""
    t = config.tp_size or (2 if config.plan_ngpus % 2 == 0 and config.plan_ngpus > 2 else 1)
    if config.plan_ngpus % t:
        raise PlanError(f"hybrid: tp_size {t} does not divide plan_ngpus {config.plan_ngpus}")
    d = config.plan_ngpus // t
    check_batch_divisible(graph, d, "hybrid")
    dp_opts, tp_opts = _dp_options(graph), _tp_options(graph, config.sequence_parallel)

    def options(op: IROp, axis: int, layouts: dict):
        return dp_opts(op, axis, layouts) if axis == 0 else tp_opts(op, axis, layouts)

    plan = plan_greedy(graph, (d, t), ("dp", "tp"), options, "hybrid")
    if t == 1:
        return plan
    pins = pin_heads(graph, t, scores(graph))  # the tp axis splits attention by heads as ``tp`` does
    if all(_tp_split(plan.partition(op)) == pins[op.name] for op in graph.ops if op.name in pins):
        return plan

    def pinned(op: IROp, axis: int, layouts: dict):
        if axis == 1 and op.name in pins:
            return [pins[op.name]]
        return options(op, axis, layouts)

    return plan_greedy(graph, (d, t), ("dp", "tp"), pinned, "hybrid")


def _tp_split(partition) -> str | None:
    """The identifier a 2-D (dp, tp) partition splits on its tp axis (``None``: whole there)."""
    return partition.splits[1][0] if len(partition.splits) > 1 else None


def hybrid_cp(graph: IRGraph, config: ComputeConfig) -> Plan:
    """dp x cp on a 2-D mesh: the outer axis splits the batch, the inner axis the sequence (as
    ``cp``, of size ``config.tp_size`` or 2)."""
    c = config.tp_size or (2 if config.plan_ngpus % 2 == 0 and config.plan_ngpus > 2 else 1)
    if config.plan_ngpus % c:
        raise PlanError(f"hybrid_cp: cp size {c} does not divide plan_ngpus {config.plan_ngpus}")
    d = config.plan_ngpus // c
    check_batch_divisible(graph, d, "hybrid_cp")
    check_sequence_divisible(graph, c, "hybrid_cp")
    dp_opts, cp_opts = _dp_options(graph), _cp_options(graph)

    def options(op: IROp, axis: int, layouts: dict):
        return dp_opts(op, axis, layouts) if axis == 0 else cp_opts(op, axis, layouts)

    plan = rows_per_chunk(graph, plan_greedy(graph, (d, c), ("dp", "cp"), options, "hybrid_cp"), 1)
    return rows_per_chunk(graph, plan, 0)  # the masks' batch rows too


def random(graph: IRGraph, config: ComputeConfig) -> Plan:
    """A seeded valid partition per operator (``config.seed``): the stress test for the harness."""
    rng = _random.Random(config.seed)
    return plan_greedy(graph, (config.plan_ngpus,), ("r",), _any_options, "random",
                       pick=lambda op, cands: rng.choice(cands))


def two_axis_meshes(world_size: int) -> list[tuple[int, int]]:
    """Every 2-D mesh ``(a, b)`` of ``world_size`` ranks with both axes at least 2; a prime (or 1)
    world size has none and gets ``(world_size, 1)``, whose second axis splits nothing."""
    out = [(a, world_size // a) for a in range(2, world_size // 2 + 1) if world_size % a == 0]
    return out or [(world_size, 1)]


def random2d(graph: IRGraph, config: ComputeConfig) -> Plan:
    """``random`` on a 2-D mesh (drawn, with every partition, from ``config.seed``): each operator
    takes a random valid partition with one identifier (or none) per axis, so one tensor is often
    split along one dim on one axis and another dim on the other, and converted between such
    layouts: the stress test for multi-axis conversions."""
    rng = _random.Random(config.seed)
    mesh = rng.choice(two_axis_meshes(config.plan_ngpus))
    return plan_greedy(graph, mesh, ("r0", "r1"), _any_options, "random2d",
                       pick=lambda op, cands: rng.choice(cands))


# each axis's option maker (graph, plus sequence_parallel for tp), for policies composed elsewhere (cp_mesh.py)
AXIS_OPTIONS = {"dp": _dp_options, "cp": _cp_options, "tp": _tp_options}

POLICIES = {"dp": dp, "tp": tp, "cp": cp, "hybrid": hybrid, "hybrid_cp": hybrid_cp, "random": random, "random2d": random2d}
