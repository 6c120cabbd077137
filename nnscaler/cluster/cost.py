"""The cost of one training step on a cluster, for a model read as repeated blocks
(:mod:`nnscaler.cluster.blocks`) under a full outer configuration (:class:`Parallel`): the recipes the
compiler has (precision, ZeRO over dp, recompute none / selective / full, tensor parallelism with or
without sequence parallelism, pipeline stages under 1F1B or interleaved 1F1B) and context parallelism
(``cp``: the sequence split over ``cp`` ranks) with closed forms. Rank order: tp innermost, then cp, dp,
pipeline stages (Megatron-LM's ``tp-cp-dp-pp``), so a group leaves its node once the ranks inside it and
inside the axes within it exceed ``ranks_per_node``.

Context parallelism (:func:`cp_exchange`): every operator but attention runs on ``1 / cp`` of each
sequence's tokens (time, saved activations, tp collectives and pipeline sends all divide by ``cp``);
attention runs the rank's queries against the whole sequence's keys and values. ``cp_scheme``
``"allgather"`` (Llama 3, Dubey et al. 2024 section 3.3.2): all-gather K and V over the cp group before
each attention forward, again in backward (only the rank's own chunk is kept), and reduce-scatter dK and
dV; the paper puts the all-gather "in the critical path", so none of it is hidden here. ``"ulysses"``
(Jacobs et al. 2023, DeepSpeed-Ulysses): attention splits its heads over the cp group instead of the
sequence, an all-to-all of q, k and v before it and of its output after (``D(seq) -> D(heads)`` and back),
the same four in backward for their gradients, none hidden (DeepSpeed issues them in the critical path);
the heads per tp rank must divide by ``cp`` (:func:`ulysses_fits`), keys and values travel with their own
heads where the key/value heads divide too, else expanded to the query heads (as a GQA model's
``repeat_kv`` has them before attention); every rank sees the whole causal sequence for its heads, so it
is balanced by construction. ``"ring"``
(Liu et al. 2023, ring attention): ``cp - 1`` sends of one K/V chunk (forward) and of K/V plus dK/dV
(backward), each hidden behind one step's attention compute, only the excess exposed. With
``cp_balanced`` (Llama 3's two chunks per rank, ``i`` and ``2 cp - 1 - i``; ring's zig-zag) every rank
gets ``1 / cp`` of the causal attention; without (contiguous chunks), the last rank's queries see the most
keys and its share, ``(2 cp - 1) / cp^2`` of the causal work, paces the step. ``cp_comm`` in the step time
is the exposed exchange plus the extra attention launches a split attention makes (a ring's ``cp - 1`` more
calls, the all-gather's second chunk), at the profile's ``op_overhead``. Not modelled: any loss of attention
kernel efficiency on the shorter blocks a split attention computes (no measured source here), so cp at
short sequences is priced optimistically. Parameters and gradients do
not change with cp; ZeRO shards over ``dp x cp`` and the gradients are reduced over ``dp x cp`` (every cp
rank holds gradients of its own tokens), as Megatron-LM's distributed optimizer and Llama 3's FSDP do.

Memory per rank: :mod:`nnscaler.cluster.memory`.
MFU: model FLOPs of a step (3 x forward: backward counted as twice the forward) over ``world x peak x step
time``, where the forward counts causal attention at half its ``s^2`` score and value products (the FLOPs
a causal kernel does), as Llama 3's MFU figures do; the model FLOPs do not depend on the plan.
Step time: ``(m + (pp - 1) / v) * t_mb`` for the slowest stage's micro-batch time ``t_mb`` (forward,
backward = 2 x forward, recompute, exposed tp all-reduces), the bubble being the ``(pp - 1) / v`` part,
plus exposed pipeline sends, the data-parallel collectives the last backward does not hide, and the
AdamW step (memory bound, over the optimizer's shard).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

from .blocks import ModelShape, Section
from .memory import LOSS_BYTES, micro_batch_saved, rank_memory
from ..cost.comm import collective_time
from ..cost.compute import BACKWARD, OPTIMIZER_TRAFFIC
from ..profiles import ClusterConstants, DeviceProfile

# bytes per parameter (params, grads, optimizer state) and per activation element, by precision; bf16-mixed
# keeps fp32 master weights, gradients and AdamW state and computes in bf16 (nnscaler.runtime.precision)
BYTES = {"32-true": (4, 4, 8, 4), "bf16-mixed": (4, 4, 8, 2), "bf16-true": (2, 2, 4, 2)}
SCHEDULES = ("1F1B", "Interleaved1F1B")


@dataclass(frozen=True)
class Parallel:
    """One outer configuration of a training step on ``tp * cp * pp * dp`` ranks (``cp``: context
    parallelism, ``cp_scheme`` one of :data:`~nnscaler.config.CP_SCHEMES`, ``cp_balanced``: causal load
    balancing of the chunks; see the module docstring)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    recompute: str = "none"
    cp: int = 1
    cp_scheme: str = "allgather"
    cp_balanced: bool = True

    @property
    def schedule(self) -> str:
        return "Interleaved1F1B" if self.virtual_stages > 1 else "1F1B"

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shards(self) -> int:
        """Ranks that hold the same parameters: the group ZeRO shards over and gradients are reduced over."""
        return self.dp * self.cp

    def as_dict(self) -> dict:
        return {**asdict(self), "schedule": self.schedule}


@dataclass
class Estimate:
    """Step time and memory per rank of one :class:`Parallel` (seconds, bytes)."""

    parallel: Parallel
    time: dict[str, float]
    memory: dict[str, float]
    mfu: float
    tokens_per_second: float
    budget: float

    @property
    def step_seconds(self) -> float:
        return self.time["total"]

    @property
    def fits(self) -> bool:
        return self.memory["peak"] <= self.budget


def bubble_fraction(pp: int, m: int, v: int = 1) -> float:
    """The idle part of a 1F1B step: ``(pp - 1) / v`` of ``m + (pp - 1) / v`` micro-batch slots."""
    idle = (pp - 1) / v
    return idle / (m + idle)


def _consts(profile: DeviceProfile) -> ClusterConstants:
    if profile.cluster is None:
        raise ValueError(f"profile {profile.name!r} has no cluster constants (peak, calibrated efficiencies)")
    return profile.cluster


def section_forward(sec: Section, tp: int, sp: bool, scale: float, c: ClusterConstants, profile: DeviceProfile,
                    act_bytes: int, causal: bool, core_only: bool = False, attention_share: float = 1.0) -> float:
    """Seconds of one forward of ``sec`` on one rank for ``scale`` times the traced sample
    (``attention_share``: the rank's attention work against ``scale`` of it, :func:`causal_share`)."""
    t = 0.0
    for o in sec.ops:
        if o.kind == "free" or (core_only and not o.core):
            continue
        div = tp if (o.split or (sp and o.tokens and o.kind == "memory")) else 1
        if o.kind == "linear":
            m, k, n = o.gemm
            m *= scale
            k, n = (k, n / tp) if o.column else (k / tp, n)
            t += o.flops * scale / tp / (c.peak * c.gemm_efficiency(m, n, k))
        elif o.kind == "attention":
            call = o.flops * scale * attention_share / div  # one call's full-score FLOPs on this rank
            t += call * (0.5 if causal else 1.0) / (c.peak * c.attention_efficiency(call))
            t += c.score_passes * o.scores * scale * attention_share * act_bytes / div / profile.mem_bw  # scores in
            # memory (no flash attention), a split attention's share of them
        else:
            t += c.fusion * o.elements * scale * act_bytes / div / profile.mem_bw
        t += profile.op_overhead
    return t


def ulysses_fits(shape: ModelShape, tp: int, cp: int) -> bool:
    """Whether Ulysses's head split over ``cp`` ranks divides the query heads each tp rank holds."""
    return shape.heads % (tp * cp) == 0


def causal_share(cp: int, causal: bool, balanced: bool) -> float:
    """The slowest cp rank's attention work over ``1 / cp`` of the whole (1 when balanced or not causal).
    Contiguous chunks: rank ``i``'s queries see ``i + 1/2`` chunks of keys on average, the last one
    ``cp - 1/2`` of the ``cp / 2`` a balanced rank sees: ``(2 cp - 1) / cp``."""
    return 1.0 if cp == 1 or balanced or not causal else (2 * cp - 1) / cp


def attention_flops(shape: ModelShape) -> float:
    """Forward FLOPs of every attention of the traced sample (scores and values in full, ``4 s^2 d`` per head)."""
    per = {n: sum(o.flops for o in getattr(shape, n).ops if o.kind == "attention") for n in ("pre", "block", "post")}
    return per["pre"] + per["post"] + shape.layers * per["block"]


def model_flops(shape: ModelShape, global_batch: int) -> float:
    """FLOPs of one training step as MFU counts them (module docstring): 3 x the forward, causal attention
    at half its scores."""
    fwd = shape.fwd_flops - (0.5 * attention_flops(shape) if shape.causal else 0.0)
    return (1 + BACKWARD) * fwd / shape.batch * global_batch


def kv_bytes(shape: ModelShape, tokens: float, tp: int, act_bytes: int) -> float:
    """Bytes of the keys and values of ``tokens`` on one tp rank (heads split over ``tp``)."""
    return 2.0 * tokens * shape.kv_heads * (shape.hidden // max(1, shape.heads)) / tp * act_bytes


def cp_exchange(shape: ModelShape, par: Parallel, profile: DeviceProfile, tokens_mb: int, act_bytes: int,
                attn_fwd: float) -> dict:
    """Seconds of context parallelism's key/value exchange in one block for one micro-batch (module
    docstring): ``fwd`` (exposed in forward), ``bwd`` (in backward), ``bytes`` (the gathered K and V of one
    block on one rank, also the working buffer the all-gather needs). ``attn_fwd``: the rank's forward
    attention seconds in that block (what a ring hides its sends behind)."""
    cp = par.cp
    if cp == 1:
        return {"fwd": 0.0, "bwd": 0.0, "bytes": 0.0}
    gathered = kv_bytes(shape, tokens_mb, par.tp, act_bytes)
    rpn = profile.ranks_per_node
    across = par.tp * cp > rpn
    if par.cp_scheme == "ulysses":  # all-to-all of q, k, v and the output (each the rank's tokens, its tp heads)
        head_dim = shape.hidden // max(1, shape.heads)
        kv_heads = shape.kv_heads if shape.kv_heads % (par.tp * cp) == 0 else shape.heads
        per_token = (2 * shape.heads + 2 * kv_heads) * head_dim / par.tp * act_bytes  # q, out, k, v
        coll = _group_collective(profile, cp, across, max(1, min(cp, rpn // par.tp)))
        a2a = coll("all_to_all", tokens_mb / cp * per_token)
        # working: q, k, v and the output in the heads layout, then their gradients (both counted, as the all-gather's)
        return {"fwd": a2a, "bwd": a2a, "bytes": tokens_mb / cp * per_token}
    if par.cp_scheme == "allgather":  # two attention calls per rank (its two chunks): one launch more each way
        coll = _group_collective(profile, cp, across, max(1, min(cp, rpn // par.tp)))
        ag, rs = coll("all_gather", gathered), coll("reduce_scatter", gathered)
        launch = profile.op_overhead
        return {"fwd": ag + launch, "bwd": ag + rs + BACKWARD * launch, "bytes": gathered}
    alpha, beta = profile.link(across)  # a ring that leaves its node goes at its slowest hop's pace
    chunk = gathered / cp
    step_fwd, step_bwd = attn_fwd / cp, attn_fwd * BACKWARD / cp
    launch = (cp - 1) * profile.op_overhead  # one attention call per step where one call did it all
    fwd = (cp - 1) * max(0.0, alpha + chunk / beta - step_fwd) + launch
    bwd = (cp - 1) * max(0.0, alpha + 2 * chunk / beta - step_bwd) + BACKWARD * launch
    return {"fwd": fwd, "bwd": bwd, "bytes": 2 * chunk}


def sac_recomputed(sec: Section) -> Section:
    """The operators of ``sec`` that torchtitan's per-op selective activation checkpointing recomputes in backward
    (its policy: of the block's matmuls in execution order the first, third, ... are saved, the second, fourth, ...
    recomputed; the attention kernel's output saved; every other operator, norms, rotary, activations and adds,
    recomputed): for a Llama block k_proj, o_proj and up_proj, ~37% of its linear FLOPs (Llama 3 8B)."""
    linears = [o for o in sec.ops if o.kind == "linear"]
    again = {id(o) for o in linears[1::2]}
    return Section([o for o in sec.ops if id(o) in again or o.kind == "memory"])


def tp_overlap_exposed(tp: int, sp: bool, overlap: bool) -> float:
    """The share of a block's tp collectives left exposed: 1/tp when the stack pipelines its sequence-parallel
    all-gathers and reduce-scatters with the GEMMs in tp chunks (the first chunk's transfer waits), else 1."""
    return 1.0 / tp if overlap and sp and tp > 1 else 1.0


def _tp_collectives(sec: Section) -> tuple[int, int]:
    return sum(o.tp_collectives for o in sec.ops), sum(o.tp_bwd_collectives for o in sec.ops)


def layer_split(layers: int, stages: int, pre: float, post: float, per_layer: float) -> tuple[list[int], float]:
    """Layers per stage (each at least one) so that the slowest stage, the first carrying ``pre`` and
    the last ``post`` seconds on top of its layers, is as fast as possible; returns (counts, slowest).
    The slowest time is one of ``pre + a t``, ``post + b t`` or ``c t``: the smallest feasible one wins."""
    if stages == 1:
        return [layers], pre + post + layers * per_layer
    eps = 1e-9

    def caps(t: float) -> tuple[int, int, int]:
        return (int((t - pre) / per_layer + eps), int((t - post) / per_layer + eps), int(t / per_layer + eps))

    def feasible(t: float) -> bool:
        a, b, c = caps(t)
        return a >= 1 and b >= 1 and (stages == 2 or c >= 1) and a + b + (stages - 2) * c >= layers

    # each of the three forms is increasing in its count and feasibility is monotone in t: the smallest
    # feasible value of each form by bisection, the smallest of those wins (3 log L steps, not L log L)
    best = []
    for base in (pre, post, 0.0):
        lo, hi = 1, layers
        if not feasible(base + hi * per_layer):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if feasible(base + mid * per_layer):
                hi = mid
            else:
                lo = mid + 1
        best.append(base + lo * per_layer)
    t = min(best) if best else max(pre, post, 0.0) + layers * per_layer
    a, b, c = caps(t)
    first = max(1, min(a, layers - (stages - 1)))
    last = max(1, min(b, layers - first - (stages - 2)))
    rest = layers - first - last
    if stages == 2:
        return [first, last + rest], max(pre + first * per_layer, post + (last + rest) * per_layer)
    base, extra = divmod(rest, stages - 2)
    counts = [first] + [base + (1 if i < extra else 0) for i in range(stages - 2)] + [last]
    return counts, max(pre + first * per_layer, post + last * per_layer, max(counts[1:-1]) * per_layer)


def _group_collective(profile: DeviceProfile, f: int, across: bool, per_node: int):
    """Seconds of a collective over a group of ``f`` ranks, ``per_node`` of them on each node. A group that
    leaves its node runs one ring per NIC (NCCL's channels), so it gets ``per_node`` NICs' bandwidth, up
    to the node's own links (a group with one rank per node gets one NIC, as the alpha-beta model has it);
    its all-reduces pay a tree's latency (``2 log2 f`` steps) instead of the ring's ``2 (f - 1)``."""
    # an all-reduce across nodes pays the latency of NCCL's tree (2 log2 f steps) where that beats the ring's
    # 2 (f - 1): the ring's latency term alone would charge 1,024 ranks ~30 ms per all-reduce
    tree = min(1.0, math.ceil(math.log2(f)) / (f - 1)) if across and f > 2 else 1.0

    def time(kind: str, nbytes: float) -> float:
        share = tree if kind == "all_reduce" else 1.0
        if not across or per_node <= 1:
            return collective_time(kind, nbytes, f, profile, across, share)
        boosted = dataclasses.replace(profile, inter_beta=min(profile.intra_beta, per_node * profile.inter_beta))
        return collective_time(kind, nbytes, f, boosted, True, share)
    return time


def _micro_batch(shape: ModelShape, par: Parallel, sp: bool, scale: float, c: ClusterConstants,
                 profile: DeviceProfile, ab: int, tokens_mb: int, weight_casts: bool = False) -> dict:
    """What one micro-batch costs per section, and what it saves, under (tp, sequence parallelism,
    micro-batch size, recompute, context parallelism): the part of :func:`estimate` that reads every
    operator of a section. ``scale``: the rank's part of the traced sample (``/ cp`` already)."""
    tp, recompute = par.tp, par.recompute
    share = causal_share(par.cp, shape.causal, par.cp_balanced or par.cp_scheme == "ulysses")
    fwd = {name: section_forward(sec, tp, sp, scale, c, profile, ab if name != "post" else LOSS_BYTES, shape.causal,
                                 attention_share=share)
           for name, sec in (("pre", shape.pre), ("block", shape.block), ("post", shape.post))}
    attn = section_forward(shape.block, tp, sp, scale, c, profile, ab, shape.causal, attention_share=share) - \
        section_forward(Section([o for o in shape.block.ops if o.kind != "attention"]), tp, sp, scale, c, profile, ab,
                        shape.causal)
    cpx = cp_exchange(shape, par, profile, tokens_mb, ab, attn)
    act_el_bytes = tokens_mb / par.cp * shape.hidden * ab  # one activation between blocks, on one cp rank
    intra = tp <= profile.ranks_per_node
    ar = collective_time("all_reduce", act_el_bytes, tp, profile, not intra) * c.tp_exposed * (c.sp_comm if sp else 1.0)
    ar *= tp_overlap_exposed(tp, sp, c.tp_comm_overlap)
    tp_f = {n: _tp_collectives(s) for n, s in (("pre", shape.pre), ("block", shape.block), ("post", shape.post))}
    tp_time = {n: (f + b) * ar for n, (f, b) in tp_f.items()}
    if recompute == "full":  # the forward again, its all-gather of K and V included
        rc = {n: fwd[n] + tp_f[n][0] * ar + cpx["fwd"] for n in ("block",)}
    elif recompute == "full-except-core":  # the forward again but its attention kernels (and so no K/V exchange)
        rc = {"block": fwd["block"] - attn + tp_f["block"][0] * ar}
    elif recompute == "selective" and c.sac_alternate_linears:
        rc = {"block": section_forward(sac_recomputed(shape.block), tp, sp, scale, c, profile, ab, shape.causal)}
    elif recompute == "selective":
        rc = {"block": section_forward(shape.block, tp, sp, scale, c, profile, ab, shape.causal, core_only=True,
                                       attention_share=share)}
    else:
        rc = {"block": 0.0}
    saved = micro_batch_saved(shape, par, sp, scale, ab, tokens_mb, weight_casts, c.weight_casts, cpx["bytes"])
    cp_block = cpx["fwd"] + cpx["bwd"]
    return {"fwd": fwd, "tp_time": tp_time, "rc": rc, "cp_time": cp_block,
            "per_layer": fwd["block"] * (1 + BACKWARD) + tp_time["block"] + rc["block"] + cp_block,
            "pre_t": fwd["pre"] * (1 + BACKWARD) + tp_time["pre"], "post_t": fwd["post"] * (1 + BACKWARD) + tp_time["post"],
            "params": (shape.pre.params(tp), shape.block.params(tp), shape.post.params(tp)),
            **saved}


def estimate(shape: ModelShape, par: Parallel, profile: DeviceProfile, precision: str, global_batch: int,
             budget: float | None = None, grad_reduce_bytes: int = 4, memo: dict | None = None) -> Estimate:
    """Step time and per-rank memory of ``par`` for ``global_batch`` sequences per optimizer step.
    ``memo``: a dict kept across calls on the same ``shape``, ``profile``, precision and world size (one
    search), so each (tp, sequence parallelism, micro-batch size, recompute) reads the sections once."""
    c = _consts(profile)
    peak_flops = c.peak
    share = profile.share(min(par.world, profile.ranks_per_node))  # an oversubscribed CPU: ranks take turns
    if share < 1:
        c = dataclasses.replace(c, peak=c.peak * share)
        profile = dataclasses.replace(profile, mem_bw=profile.mem_bw * share, op_overhead=profile.op_overhead / share)
    pb, gb, ob, ab = BYTES[precision]
    tp, cp, pp, dp, v, m = par.tp, par.cp, par.pp, par.dp, par.virtual_stages, par.num_microbatches
    sp = par.sequence_parallel and tp > 1
    scale = par.micro_batch_size / shape.batch / cp
    tokens_mb = par.micro_batch_size * shape.seq  # the micro-batch's tokens, over its cp ranks
    key = (tp, sp, par.micro_batch_size, par.recompute, cp, par.cp_scheme if cp > 1 else "", par.cp_balanced)
    costs = memo.get(key) if memo is not None else None
    if costs is None:
        costs = _micro_batch(shape, par, sp, scale, c, profile, ab, tokens_mb,
                             precision == "bf16-mixed" and c.weight_casts)
        if memo is not None:
            memo[key] = costs
    tp_time, rc = costs["tp_time"], costs["rc"]
    act_el_bytes = tokens_mb / cp * shape.hidden * ab  # one activation between blocks, on one cp rank
    chunks = pp * v
    split = costs.setdefault("split", {})  # by chunks: the ZeRO stages and micro-batch counts share it
    if chunks not in split:
        split[chunks] = layer_split(shape.layers, chunks, costs["pre_t"], costs["post_t"], costs["per_layer"])
    counts, slow_chunk = split[chunks]
    # a rank runs v chunks; its per-micro-batch time is v chunk times (balanced: v x the slowest chunk)
    t_mb = slow_chunk * v if v > 1 else slow_chunk
    # --- pipeline -----------------------------------------------------------------------------------------
    idle = (pp - 1) / v
    bubble = idle * t_mb
    p2p_bytes = act_el_bytes / (tp if sp else 1)
    # rank order tp (innermost), cp, dp, pp (Megatron-LM's): neighbouring stages are tp x cp x dp ranks apart
    across = tp * cp * dp >= profile.ranks_per_node
    alpha, beta = profile.link(across)
    p2p = alpha + p2p_bytes / beta
    pp_comm = 2 * (m * v + pp - 1) * p2p * c.pp_exposed if pp > 1 else 0.0
    # --- state and data parallelism -----------------------------------------------------------------------
    layers_max = max(counts) if v == 1 else max(counts) * v
    pre_p, block_p, post_p = costs["params"]
    stage_params = max(pre_p + counts[0] * block_p * (1 if v == 1 else v),
                       post_p + counts[-1] * block_p * (1 if v == 1 else v), layers_max * block_p)
    if pp == 1:  # one stage holds the embedding and the head both (Llama-3 8B: measured 0.93 of the bytes
        stage_params = pre_p + post_p + layers_max * block_p  # without the head, bench/calibration/real_memory.py)
    # gradients are reduced, and ZeRO shards, over the dp x cp ranks that hold the same parameters
    shard = par.shards
    dp_across = tp * shard > profile.ranks_per_node
    dp_coll = _group_collective(profile, shard, dp_across, max(1, min(shard, profile.ranks_per_node // tp)))
    grad_bytes = stage_params * grad_reduce_bytes
    dp_comm = 0.0
    if shard > 1:
        if par.zero == 0:
            dp_comm = dp_coll("all_reduce", grad_bytes)
        elif par.zero == 1:  # reduce-scatter the gradients, all-gather the updated parameters at the compute dtype
            dp_comm = dp_coll("reduce_scatter", grad_bytes) + dp_coll("all_gather", stage_params * ab)
        elif par.zero == 2:  # reduce-scatter after every micro-batch, all-gather of the updated shard once
            dp_comm = m * dp_coll("reduce_scatter", grad_bytes) + dp_coll("all_gather", stage_params * pb)
        else:  # gather parameters for forward and backward, reduce-scatter gradients, every micro-batch
            dp_comm = m * (2 * dp_coll("all_gather", stage_params * ab) + dp_coll("reduce_scatter", grad_bytes))
    # what hides the collectives: ZeRO-3 prefetches across the whole step and hides a fixed part of its own traffic
    # (``zero3_overlap``: the first gather and the last reduce-scatter have nothing to hide behind, and the transfers
    # slow the GEMMs they overlap), at most the whole compute of the step; ZeRO-2 reduce-scatters behind every
    # backward, ZeRO-1 its reduce-scatter behind the last micro-batch's backward and its all-gather behind the next
    # step's first forward (Megatron-LM's overlapped gradient reduce and parameter gather), ZeRO-0 all-reduce buckets
    # behind the last micro-batch's backward
    z3 = c.zero3_overlap if c.zero3_overlap_across is None or not dp_across else c.zero3_overlap_across
    hide = (min(z3 * dp_comm, m * t_mb) if par.zero >= 3 else
            c.dp_overlap * (m * t_mb * BACKWARD / (1 + BACKWARD) if par.zero == 2 else
                            t_mb if par.zero == 1 else t_mb * BACKWARD / (1 + BACKWARD)))
    hidden = min(dp_comm, hide)
    # ZeRO-3's fitted overlap already nets out the slowdown of the compute it overlaps; ZeRO 0-2 pay it here
    dp_exposed = dp_comm - hidden + (c.overlap_slowdown * hidden if par.zero < 3 else 0.0)
    optimizer = OPTIMIZER_TRAFFIC * stage_params * 4 / (shard if par.zero >= 1 else 1) / profile.mem_bw
    # the slowest stage's m micro-batches, broken down (its recompute and exposed tp collectives apart)
    recompute = m * rc["block"] * max(counts) * v
    tp_exposed_t = m * (tp_time["block"] * max(counts) * v + max(tp_time["pre"], tp_time["post"]))
    cp_exposed_t = m * costs["cp_time"] * max(counts) * v
    compute = m * t_mb - recompute - tp_exposed_t - cp_exposed_t
    total = m * t_mb + bubble + pp_comm + dp_exposed + optimizer
    memory = rank_memory(shape, par, costs, counts, pb, gb, ob, tokens_mb)
    tokens = global_batch * shape.seq
    mfu = model_flops(shape, global_batch) / (total * par.world * peak_flops)
    times = {"compute": compute, "recompute": recompute, "tp_comm": tp_exposed_t, "cp_comm": cp_exposed_t,
             "pp_comm": pp_comm,
             "dp_comm": dp_exposed, "bubble": bubble, "optimizer": optimizer, "total": total}
    return Estimate(par, times, memory, mfu, tokens / total,
                    budget if budget is not None else c.usable * profile.memory)

