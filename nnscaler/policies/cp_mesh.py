"""Context parallelism composed with the other axes: ``cp_tp``, dp x cp x tp on one mesh (Megatron-LM's
rank order: tp innermost, then cp, then dp). Inside a pipeline stage (``pp2_cp_tp``) it is each stage's
policy; ZeRO shards over the axes that hold a parameter whole (dp and cp) and recompute applies as under
any policy. It is what :func:`nnscaler.cluster.plan.lower` runs for a cluster plan with ``cp`` > 1.
``ulysses``: the sequence split as ``cp`` but attention split by heads, an all-to-all each way;
``cp_tp_ulysses``: the same under tp (dp x tp x cp), attention's heads split on tp and then, inside each tp
rank's heads, on cp.

Attention splits its heads on the tp axis and its queries' sequence on the cp axis; keys and values are
all-gathered on the cp axis alone (the layout conversion ``D -> R`` on that axis, its backward summing
their gradients back to the owning chunk), the head split staying in place. Chunks are contiguous (no
causal balance)."""
from __future__ import annotations

from ..config import ComputeConfig, PlanError
from ..dimops.partition import splittable
from ..ir.graph import IRGraph, IROp, IRTensor
from ..ir.plan import Plan
from .builtin import AXIS_OPTIONS, batch_identifiers, check_batch_divisible, check_sequence_divisible, no_weight_matrix
from .greedy import plan_greedy
from .heads import pin_heads, scores
from .masks import rows_per_chunk


def cp_tp_mesh(config: ComputeConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ``(shape, names)`` of ``cp_tp``'s mesh: tp of ``config.tp_size`` (default 2 where it divides),
    cp of ``config.cp_size`` (default every rank left), dp the rest; axes of one rank left out (one at least)."""
    n = config.plan_ngpus
    t = config.tp_size or (2 if n % 2 == 0 and n > 2 else 1)
    if n % t:
        raise PlanError(f"cp_tp: tp_size {t} does not divide plan_ngpus {n}")
    c = config.cp_size or n // t
    if n % (t * c):
        raise PlanError(f"cp_tp: cp_size {c} x tp_size {t} does not divide plan_ngpus {n}")
    sizes = (("dp", n // (t * c)), ("cp", c), ("tp", t))
    kept = [(a, s) for a, s in sizes if s > 1] or [("cp", 1)]
    return tuple(s for _, s in kept), tuple(a for a, _ in kept)


def sp_ops(graph: IRGraph) -> set[str]:
    """The operators sequence parallelism splits by the sequence on tp (no weight matrix, a sequence dim apart
    from the batch's): under cp their sequence is split on cp, then again on tp inside each cp chunk."""
    batch, seq = batch_identifiers(graph), batch_identifiers(graph, 1)
    return {op.name for op in graph.ops if op.known and seq.get(op.name) is not None
            and seq[op.name] != batch[op.name] and no_weight_matrix(op)}


def refuse_sp_under_cp(config: ComputeConfig, size: dict[str, int], policy: str) -> None:
    """A :class:`PlanError` for ``sequence_parallel`` with both cp and tp above 1 where the sequence is held in
    the balanced order or split by heads inside attention (Ulysses): a split nested inside those has no layout
    (:func:`~nnscaler.dimops.partition.check_partition`), so such a plan would run without sp, unlike it was costed."""
    if config.sequence_parallel and size.get("cp", 1) > 1 and size.get("tp", 1) > 1:
        raise PlanError(f"{policy}: sequence_parallel with cp_size {size['cp']} > 1 is not lowered (a sequence split on "
                        f"tp nested inside {'heads split' if 'ulysses' in policy else 'balanced chunks'} on cp has no "
                        f"layout): set sequence_parallel=False, or use contiguous chunks (cp_tp, cp_tp_ring)")


def cp_tp(graph: IRGraph, config: ComputeConfig) -> Plan:
    """dp x cp x tp: the batch split on dp, the sequence on cp (as ``cp``), heads and weights on tp (as
    ``hybrid``'s tp axis, with ``config.sequence_parallel``; attention and its q/k/v path pinned to their
    heads as ``tp`` pins them, :mod:`nnscaler.policies.heads`); see the module docstring."""
    mesh, names = cp_tp_mesh(config)
    size = dict(zip(names, mesh))
    check_batch_divisible(graph, size.get("dp", 1), "cp_tp")
    check_sequence_divisible(graph, size.get("cp", 1), "cp_tp")
    # sequence parallelism on tp splits the sequence of norms and residuals, which the cp axis holds split already:
    # there the tp axis cuts each cp chunk again (a nested split of the sequence, sp_ops); the rest of tp offers
    # Megatron's choices (a norm's weight split by hidden instead made the MLP row-parallel, check_lowering)
    sp = config.sequence_parallel
    per_axis = [AXIS_OPTIONS[a](graph, sp) if a == "tp" else AXIS_OPTIONS[a](graph) for a in names]
    tp_axis = names.index("tp") if "tp" in names else None
    pins = pin_heads(graph, size["tp"], scores(graph)) if tp_axis is not None else {}

    def options(op, axis: int, layouts: dict):  # attention by heads on tp (as ``tp`` pins them), carried to the projections
        if axis == tp_axis and op.name in pins:
            return [pins[op.name]]
        return per_axis[axis](op, axis, layouts)

    nested = sp_ops(graph) if sp and size.get("cp", 1) > 1 else ()
    plan = plan_greedy(graph, mesh, names, options, "cp_tp", nested=nested)
    for axis in [names.index(a) for a in ("cp", "dp") if a in names]:  # masks per chunk (their batch rows too)
        plan = rows_per_chunk(graph, plan, axis)
    return plan


MATMUL = ("matmul", "bmm")


def attention_core(graph: IRGraph) -> set[str]:
    """The operators of each attention from its score product to its value product: the ``q k^T``
    matmul, what runs on the scores (scale, mask, softmax, dropout) and the ``p v`` matmul (sdpa: itself)."""
    core: set[str] = set()
    for s in scores(graph):
        core.add(s.name)
        if "scaled_dot_product_attention" in s.overload:
            continue
        x = s.inputs[0] if isinstance(s.inputs[0], IRTensor) else None
        while x is not None and x.producer is not None:  # back to q k^T
            p = x.producer
            core.add(p.name)
            if any(m in p.overload for m in MATMUL):
                break
            x = next((i for i in p.inputs if isinstance(i, IRTensor) and i.shape == x.shape), None)
        y = s.outputs[0]
        while y is not None:  # on to p v (through casts and dropout; eager attention also returns the weights)
            c = next((c for c in y.consumers if c.outputs and c.outputs[0] is not None and (
                any(m in c.overload for m in MATMUL) or c.outputs[0].shape == y.shape)), None)
            if c is None:
                break
            core.add(c.name)
            if any(m in c.overload for m in MATMUL):
                break
            y = c.outputs[0]
    return core


def ulysses(graph: IRGraph, config: ComputeConfig) -> Plan:
    """Context parallelism by DeepSpeed-Ulysses's exchange: the sequence split on the cp axis
    everywhere except inside attention (:func:`attention_core`), which splits its heads instead; the
    layout conversion between the two is an all-to-all of queries, keys and values in and of the
    attention output back (``D(seq) -> D(heads)``). The heads must divide by the cp degree:
    ``config.cp_size`` (default ``plan_ngpus``), the ranks left a dp axis outside it (dp x cp, the batch
    split on dp as ``hybrid_cp`` splits it; no tp axis)."""
    n = config.cp_size or config.plan_ngpus
    if config.plan_ngpus % n:
        raise PlanError(f"ulysses: cp_size {n} does not divide plan_ngpus {config.plan_ngpus}")
    dp = config.plan_ngpus // n
    check_batch_divisible(graph, dp, "ulysses")
    check_sequence_divisible(graph, n, "ulysses")
    pins = pin_heads(graph, n, scores(graph))
    core = attention_core(graph)
    missing = [op.name for op in graph.ops if op.name in core and not pins.get(op.name)]
    if missing:
        raise PlanError(f"ulysses: attention operator {missing[0]} cannot split its heads over {n} ranks "
                        f"(heads not divisible, or not found)")
    seq = AXIS_OPTIONS["cp"](graph)
    batch = AXIS_OPTIONS["dp"](graph) if dp > 1 else None

    def options(op: IROp, axis: int, layouts: dict):
        if batch is not None and axis == 0:
            return batch(op, axis, layouts)
        return [pins[op.name]] if op.name in core else seq(op, axis, layouts)

    mesh, names = ((dp, n), ("dp", "cp")) if dp > 1 else ((n,), ("cp",))
    return plan_greedy(graph, mesh, names, options, "ulysses")


def ulysses_tp_mesh(config: ComputeConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ``(shape, names)`` of ``cp_tp_ulysses``'s mesh: dp, tp, cp (cp innermost: the heads attention holds
    are cut on tp first and each tp rank's heads on cp, the nesting convention of
    :mod:`nnscaler.comm.conversion`, so the all-to-all stays inside one tp rank's heads); degrees as
    :func:`cp_tp_mesh`'s, axes of one rank left out."""
    shape, names = cp_tp_mesh(config)
    size = dict(zip(names, shape))
    kept = [(a, size[a]) for a in ("dp", "tp", "cp") if a in size]
    return tuple(s for _, s in kept), tuple(a for a, _ in kept)


def cp_tp_ulysses(graph: IRGraph, config: ComputeConfig) -> Plan:
    """Ulysses under tp: dp x tp x cp (:func:`ulysses_tp_mesh`). Outside attention every operator is planned
    as ``cp_tp`` plans it (the sequence on cp, heads and weights on tp, Megatron's column- then row-parallel
    projections); inside attention (:func:`attention_core`) the heads are split on tp and, nested inside each
    tp rank's heads, on cp, so queries, keys and values reach it by one all-to-all on the cp axis
    (sequence -> heads, ``D(seq) -> D(heads)``, within the tp rank's heads) and the output leaves by the
    reverse one. Each tp rank's heads (query and key/value heads) must divide by the cp degree: refused by
    name otherwise. Sequence parallelism on tp is refused (the cp axis splits the sequence already)."""
    mesh, names = ulysses_tp_mesh(config)
    size = dict(zip(names, mesh))
    tp, n = size.get("tp", 1), size.get("cp", 1)
    refuse_sp_under_cp(config, size, "cp_tp_ulysses")
    check_batch_divisible(graph, size.get("dp", 1), "cp_tp_ulysses")
    check_sequence_divisible(graph, n, "cp_tp_ulysses")
    att = scores(graph)
    core = attention_core(graph)
    both = pin_heads(graph, tp * n, att)
    missing = [op.name for op in graph.ops if op.name in core and not both.get(op.name)]
    if missing:
        raise PlanError(f"cp_tp_ulysses: attention operator {missing[0]} cannot split its heads over tp x cp = "
                        f"{tp} x {n} ranks: the heads of each of the {tp} tp ranks (query and key/value heads) "
                        f"must divide by cp={n} (or heads not found)")
    pins = pin_heads(graph, tp, att) if tp > 1 else {}
    per_axis = {a: AXIS_OPTIONS[a](graph, False) if a == "tp" else AXIS_OPTIONS[a](graph) for a in names}
    # dtype asserts on attention's scores (eager attention's softmax output) check them where they are, in the
    # heads layout: offered every split, the greedy keeps the layout they arrive in (no all-to-all of S^2 scores)
    checks = {c.name for op in graph.ops if op.name in core for t in op.outputs if t is not None
              for c in t.consumers if c.overload == "aten._assert_tensor_metadata.default"}

    def options(op: IROp, axis: int, layouts: dict):
        name = names[axis]
        if name == "cp" and op.name in core:
            return [both[op.name]]
        if name == "cp" and op.name in checks:
            return [None, *splittable(op.bound)]
        if name == "tp" and op.name in pins:
            return [pins[op.name]]
        return per_axis[name](op, axis, layouts)

    return plan_greedy(graph, mesh, names, options, "cp_tp_ulysses", nested=core | checks)
