"""Memory per rank of a training step on a cluster (the most loaded stage), for a model read as repeated blocks
(:mod:`nnscaler.cluster.blocks`) under an outer configuration (:class:`~nnscaler.cluster.cost.Parallel`); the step
time is :mod:`nnscaler.cluster.cost`, which calls :func:`micro_batch_saved` and :func:`rank_memory`.

  params / grads / optimizer: bytes per parameter by precision (``BYTES``), divided by ``tp`` where
  tensor parallelism splits them, by ``dp`` for the state ZeRO shards (1: optimizer, 2: + grads, 3: +
  params, which then gather two blocks at a time into ``buffers``);
  activations: saved elements per block (split ones / tp, the rest / tp only under sequence parallelism)
  times the blocks in flight: a 1F1B stage ``s`` holds ``min(pp - s, m)`` micro-batches, stage 0 the
  most; interleaving with ``v`` virtual stages holds torch's warm-up of chunk forwards (:func:`in_flight`;
  stage 0: ``1 + (pp - 1) / (pp v)`` times as many, Korthikanti et al. 2022), each chunk's forwards counted
  with its own blocks (:func:`saved_in_flight`); ``full`` recompute keeps only each
  block's input plus one block's working set, ``selective`` keeps the attention core's checkpointed region's
  boundary (its inputs, its outputs saved after it: ``OpFacts.boundary``) in place of its saved tensors; a pipeline
  stage also holds the tensors it exchanges, whole, with a receive buffer per micro-batch
  (:func:`stage_boundaries`).
"""
from __future__ import annotations

import functools

from ..runtime.grad_sync import BUCKET_BYTES
from ..runtime.zero import IN_FLIGHT as ZERO_IN_FLIGHT
from ..runtime.zero3 import KEEP as ZERO3_KEEP
from .blocks import ModelShape, Section

LOSS_BYTES = 4  # the loss (log-softmax over the vocabulary) runs in fp32 under autocast


def in_flight(pp: int, stage: int, m: int, v: int = 1) -> float:
    """Micro-batches of activations stage ``stage`` holds at its peak under 1F1B (``v`` = 1) or
    interleaved 1F1B (``v`` virtual stages, in units of the stage's whole layers): the chunk forwards of
    torch's ``ScheduleInterleaved1F1B`` warm-up, ``2 (pp - 1 - stage) + (v - 1) pp``, and the one more its
    steady state runs before a backward, never more than the ``m v`` there are (stage 0:
    ``pp (1 + (pp - 1) / (pp v))``, Korthikanti et al. 2022; the last stage ``((v - 1) pp + 1) / v``)."""
    if v == 1:
        return float(min(pp - stage, m))
    return min(m * v, 2 * (pp - 1 - stage) + (v - 1) * pp + 1) / v


@functools.lru_cache(maxsize=None)
def chunk_forwards_in_flight(pp: int, stage: int, m: int, v: int = 1) -> tuple[tuple[int, ...], ...]:
    """Per chunk of stage ``stage``, its forwards whose backward has not run, at each moment of torch's interleaved 1F1B
    order (``ScheduleInterleaved1F1B``: forward ``k`` runs chunk ``(k // pp) % v``, backward ``k`` chunk ``v - 1`` less
    that; :func:`in_flight`'s warm-up, then one forward and one backward): the moments no other holds at least as many
    of, chunk by chunk. The warm-up runs the early chunks' forwards more often than the late ones' (pp 9, v 6, stage 0:
    chunk 0 17 times, the others 9), so a stage whose chunks hold unequal blocks saves more, or less, than its blocks
    times :func:`in_flight` (measured at real width on fake tensors: bench/results/real_memory.md, round 14)."""
    if v == 1:
        return ((int(in_flight(pp, stage, m)),),)
    total = m * v
    warm = min(total, 2 * (pp - 1 - stage) + (v - 1) * pp)
    alive, moments = [0] * v, set()

    def forward(k: int) -> None:
        alive[(k // pp) % v] += 1
        moments.add(tuple(alive))
    for k in range(warm):
        forward(k)
    for b in range(total):  # the steady state: a forward (while any is left), then a backward
        if warm + b < total:
            forward(warm + b)
        alive[v - 1 - (b // pp) % v] -= 1
    return tuple(x for x in moments if not any(y != x and all(a <= c for a, c in zip(x, y)) for y in moments))


def saved_in_flight(pp: int, stage: int, m: int, v: int, per_chunk: list[float]) -> float:
    """The most a stage holds saved at once, ``per_chunk[c]`` bytes for each forward of its chunk ``c`` in flight
    (:func:`chunk_forwards_in_flight`)."""
    return max(sum(n * w for n, w in zip(x, per_chunk)) for x in chunk_forwards_in_flight(pp, stage, m, v))


def stage_boundaries(pp: int, stage: int, m: int, v: int, whole: float) -> float:
    """Bytes stage ``stage`` holds at its peak for the tensors it exchanges with its neighbours (``whole``: one
    micro-batch's activation between blocks, whole: the runtime passes whole tensors to every rank of a stage,
    sequence parallelism or not, at the residual stream's dtype). torch's ``PipelineStage``
    (nnscaler/runtime/pipeline.py) allocates, once for every micro-batch of the step and for the whole run, a
    receive buffer of each chunk's input (not the model's first chunk) and of each chunk's output gradient (not the
    last); the received input's gradient accumulates on its buffer until the next step; each chunk's output is kept
    until its backward. At the end of the steady state (the last forward): every buffer, the chunk forwards in flight,
    and the input gradients of the backwards run so far (measured at real width on fake tensors:
    bench/results/real_memory.md)."""
    if pp == 1:
        return 0.0
    n_in = v - (1 if stage == 0 else 0)  # chunks that receive their input
    n_out = v - (1 if stage == pp - 1 else 0)  # chunks that send an output (and receive its gradient)
    chunks = in_flight(pp, stage, m, v) * v  # chunk forwards whose backward has not run
    outputs = chunks * n_out / v
    input_grads = max(0.0, m * v - chunks) * n_in / v
    return whole * (m * (n_in + n_out) + outputs + input_grads)


def section_saved(sec: Section, tp: int, sp: bool, scale: float, act_bytes: float, drop_core: bool = False,
                  fp32_bytes: float | None = None, ring: bool = False) -> float:
    """Bytes of activations one forward of ``sec`` leaves saved on one rank; ``fp32_bytes`` (bf16-mixed: 4): the
    bytes of an element autocast keeps in fp32 (``OpFacts.saved_fp32``: the residual stream, norms, rotary).
    ``ring``: attention runs as context parallelism's ring (nnscaler/runtime/ring.py), which reads the mask the
    model built, as it is, in every block: no per-call bias of it (``OpFacts.mask_bias``) as torch's attention keeps."""
    total = 0.0
    wide = act_bytes if fp32_bytes is None else fp32_bytes
    for o in sec.ops:
        if drop_core and o.core:  # selective: the recomputed region's boundary in place of its saved tensors
            total += (o.boundary / tp + o.boundary_whole / (tp if sp else 1)) * scale * act_bytes
            total += (o.boundary_fp32 / tp + o.boundary_whole_fp32 / (tp if sp else 1)) * scale * (wide - act_bytes)
            continue
        total += (o.saved / tp + o.saved_whole / (tp if sp else 1)) * scale * act_bytes
        if o.repeat_heads and tp >= o.repeat_heads:  # one head of the base a rank: the repeat is a view of it
            views, bases = o.saved_repeat, o.saved_repeat_base
            if fp32_bytes is None:  # no autocast: nothing casts them afresh
                views, bases = views + o.saved_repeat_cast, bases + o.saved_repeat_cast_base
            total -= (views / tp - bases / o.repeat_heads) * scale * act_bytes
        total += (o.saved_fp32 / tp + o.saved_whole_fp32 / (tp if sp else 1)) * scale * (wide - act_bytes)
        if fp32_bytes is not None:  # bf16-mixed: autocast's bf16 copies in place of the one tensor they copy
            total += (o.saved_gathered - o.saved_shared / (tp if sp else 1)) * scale * act_bytes
            total += 0.0 if ring else o.mask_bias * scale * act_bytes
    return total


def mask_elements(seq: int, tokens_mb: int, par) -> float:
    """Elements (bools) of the causal mask one rank builds for one micro-batch of ``tokens_mb`` tokens in sequences of
    ``seq``: the mask is built from positions with a broadcast head dim (transformers' ``sdpa_mask``), so the rank
    builds the query rows its attention reads against every key column. All-gather and ring cp read the rank's
    ``1 / cp`` of the rows (``nnscaler/policies/masks.py`` builds them per chunk); Ulysses attends every query of the
    rank's heads, and a mask with one head cannot be split by heads, so each rank builds it whole. Checked against the
    compiled programs: ``tests/compiler/test_cp_mask_memory.py``."""
    rows = tokens_mb if par.cp > 1 and par.cp_scheme == "ulysses" else tokens_mb / par.cp
    return rows * seq


def micro_batch_saved(shape: ModelShape, par, sp: bool, scale: float, ab: int, tokens_mb: int,
                      weight_casts: bool, stack_casts: bool, cp_bytes: float) -> dict:
    """What one micro-batch leaves saved per section and needs beside it, under (tp, sequence parallelism,
    micro-batch size, recompute, context parallelism): ``weight_casts``: bf16-mixed's bf16 weight copies (nnscaler's
    runtime); ``stack_casts``: the profile's ``weight_casts`` (off for the published stacks); ``cp_bytes``: the
    gathered K and V of one block (``cp_exchange``)."""
    tp, recompute = par.tp, par.recompute
    act_el_bytes = tokens_mb / par.cp * shape.hidden * ab  # one activation between blocks, on one cp rank
    # bf16-mixed casts every fp32 weight to bf16 where it is read, and the linear keeps that copy for its
    # backward: 2 bytes per (tp-split) block parameter per micro-batch in flight, unless the block is
    # recomputed (measured at real width on fake tensors: bench/calibration/real_memory.py; 112 MiB per
    # 4096 x 14336 weight of Llama-3 8B, kept until its backward)
    casts = shape.block.params(tp) * ab if weight_casts else 0.0
    wide = 4 if weight_casts else None  # bf16-mixed: what autocast keeps in fp32 saved at 4 bytes (OpFacts.saved_fp32)
    ring = par.cp > 1 and par.cp_scheme == "ring"
    full_act = section_saved(shape.block, tp, sp, scale, ab, fp32_bytes=wide, ring=ring) + casts
    if recompute == "full":  # each block's input: bf16-mixed's residual stream is fp32 (measured 0.25 GiB a 70B block)
        per_layer_act, working = act_el_bytes * (wide or ab) / ab / (tp if sp else 1), full_act
    elif recompute == "full-except-core":  # the block's input, and what its attention kernel keeps (its q, k, v
        # and output are the regions' outputs and input: kept once, nnscaler/codegen/recompute.py); a block's whole
        # activations again while its regions are recomputed
        kernel = Section([o for o in shape.block.ops if o.kind == "attention"])
        per_layer_act = act_el_bytes * (wide or ab) / ab / (tp if sp else 1) + \
            section_saved(kernel, tp, sp, scale, ab, fp32_bytes=wide, ring=ring)
        working = full_act
    elif recompute == "selective":
        per_layer_act, working = section_saved(shape.block, tp, sp, scale, ab, drop_core=True, fp32_bytes=wide,
                                                     ring=ring) + \
            casts, 0.0
    else:
        per_layer_act, working = full_act, 0.0
    working += cp_bytes * 2  # the gathered K and V, then their gradients before the reduce-scatter
    # nnscaler's program (not counted for the published stacks, ``stack_casts`` off), measured at real width on fake
    # tensors (bench/results/real_memory.md, labelled by bench/calibration/memory_labels.py): each chunk forward keeps
    # its own causal mask (``seq^2`` bools a sequence, the rank's query rows: :func:`mask_elements`) and rotary tables
    # (cos and sin, fp32), and its first block's input is not saved apart: it is a view of the chunk's received input (a boundary) or, on the
    # model's first chunk, of the embedding's output, kept whole (before any sequence-parallel split) at the residual
    # stream's dtype per micro-batch in flight
    rows = tokens_mb / par.cp
    first_input = rows * shape.hidden * (wide or ab) / (tp if sp else 1)
    mask = mask_elements(shape.seq, tokens_mb, par) if shape.causal else 0.0
    rotary = 2 * rows * (shape.hidden // max(1, shape.heads)) * 4
    chunk_act = mask + rotary - first_input if stack_casts else 0.0
    embed_act = rows * shape.hidden * (wide or ab) if stack_casts else 0.0
    return {
        "chunk_act": chunk_act, "embed_act": embed_act,
        "per_layer_act": per_layer_act, "working": working,
        "pre_act": section_saved(shape.pre, tp, sp, scale, ab, fp32_bytes=wide),
        # bf16-mixed: the head's saved tensors by their dtypes, and its weight's bf16 copy (as a block's casts)
        "post_act": (section_saved(shape.post, tp, sp, scale, ab, fp32_bytes=wide) + shape.post.params(tp) * ab
                 if weight_casts else section_saved(shape.post, tp, sp, scale, LOSS_BYTES)),
        # the loss's transient at the end of the forward: the shifted logits, fp32, before their exp (opzoo/kernels.py)
        "post_working": tokens_mb / par.cp * shape.vocab / tp * LOSS_BYTES,
        # a stage's input and output, the residual stream (fp32 under bf16-mixed), as nnscaler's runtime holds them
        # (stage_boundaries); not counted for the published stacks (weight_casts off), which send and keep them
        # otherwise (Megatron-LM: one buffer per send, split under sequence parallelism)
        "boundary_bytes": wide or (ab if stack_casts else 0)}


def rank_memory(shape: ModelShape, par, costs: dict, counts: list[int], pb: int, gb: int, ob: int,
                tokens_mb: int) -> dict:
    """Bytes per rank of ``par`` (params, grads, optimizer, activations, working, buffers, peak) from one micro-batch's
    saved tensors (``costs``: :func:`micro_batch_saved` and the sections' ``params``) and the layers of each chunk
    (``counts``, ``pp x v`` of them); ``pb``, ``gb``, ``ob``: bytes per parameter, gradient and optimizer state."""
    tp, cp, pp, v, m = par.tp, par.cp, par.pp, par.virtual_stages, par.num_microbatches
    pre_p, block_p, post_p = costs["params"]
    shard = par.shards
    # the parameters a rank holds (memory): each stage's own chunks, ``counts[c pp + s]`` for its v chunks, where the
    # time terms above take every chunk at the largest chunk's blocks (measured at real width on fake tensors: the
    # interleaved Llama-3 405B plans read 1.02-1.04 of their state, bench/results/real_memory.md)
    stage_blocks = [sum(counts[c * pp + s] for c in range(v)) for s in range(pp)]
    held_params = (pre_p + post_p + stage_blocks[0] * block_p if pp == 1 else
                   max(pre_p + stage_blocks[0] * block_p, post_p + stage_blocks[-1] * block_p,
                       max(stage_blocks) * block_p))
    params_b = held_params * pb / (shard if par.zero >= 3 else 1)
    grads_b = held_params * gb / (shard if par.zero >= 2 else 1)
    optim_b = held_params * ob / (shard if par.zero >= 1 else 1)
    # --- activations ----------------------------------------------------------------------------------------
    # saved activations (``activations``), and what is alive beside them at the peak (``working``, ``buffers``), taken
    # at two moments (measured at real width on fake tensors: bench/results/real_memory.md): the end of the forward of
    # the stage holding the head (every block's saved tensors, the head's, the loss's fp32 transient; ZeRO 3: the head's
    # gathered weight), and a block's backward (a recomputed block's whole activations, after the head's backward freed
    # its saved tensors; ZeRO 3: two gathered blocks). ZeRO 3 gathers the fp32 master weights (``pb``: the program
    # casts each where it reads it) and keeps the last two buckets (nnscaler/runtime/zero3.py, KEEP). Under ZeRO 2/3
    # with one micro-batch no gradient exists yet at the end of the forward.
    per_layer_act, working = costs["per_layer_act"], costs["working"]

    def saved(s: int) -> float:
        """Stage ``s``'s saved tensors at its fullest moment: each chunk forward in flight its own blocks' and the
        chunk's own tensors (masks, rotary; first inputs not apart), the model's first chunk the embedding's too."""
        return saved_in_flight(pp, s, m, v, [
            counts[c * pp + s] * per_layer_act + costs["chunk_act"] +
            (costs["pre_act"] + costs["embed_act"] if s == 0 and c == 0 else 0.0) for c in range(v)])
    act_stage0, act_last = saved(0), saved(pp - 1)
    # the tensors a pipeline stage exchanges, whole, at the residual stream's dtype (fp32 under bf16-mixed: the
    # embedding's output is fp32), on the first and the last stage
    whole = tokens_mb / cp * shape.hidden * costs["boundary_bytes"]
    bound0, bound_last = (stage_boundaries(pp, s, m, v, whole) for s in (0, pp - 1))
    head_saved, head_working = costs["post_act"], costs["post_working"]
    zero3 = par.zero >= 3 and shard > 1
    fixed = shape.buffers_bytes + 2 * BUCKET_BYTES
    # ZeRO 3 in a block's backward: a bucket is one weight once it reaches BUCKET_BYTES (nnscaler/runtime/zero.py),
    # so what is gathered at once is a few weights, not whole blocks: the KEEP buckets the (recomputed) forward's
    # cache holds, one regathered for a saved weight's backward, and the IN_FLIGHT packed fp32 gradient of the bucket
    # being reduce-scattered, each at most the block's largest weight (fp32). Measured at real width on fake tensors
    # (Llama-2 70B, ZeRO 3, full recompute: 2.9 GiB live at the backward's peak where two whole fp32 blocks, 6.4 GiB,
    # were counted; bench/results/real_memory.md)
    largest = max((o.params / (tp if o.params_split else 1) for o in shape.block.ops), default=0.0)
    bucket = max(largest * pb, BUCKET_BYTES)
    gather_blocks, gather_head = ((ZERO3_KEEP + 1 + ZERO_IN_FLIGHT) * bucket, post_p * pb) if zero3 else (0.0, 0.0)
    # under ZeRO 2/3 with one micro-batch no gradient exists yet at the end of the forward, nor at the first block's
    # backward (the moment with every block's saved tensors): the blocks' gradient shards come as their backward runs
    grads_fwd = 0.0 if par.zero >= 2 and m == 1 else grads_b
    body = act_stage0 if pp == 1 else act_last  # the blocks' saved tensors on the stage holding the head
    moments = [  # (saved, working, buffers, gradients) at each moment
        (body + head_saved, head_working, fixed + gather_head + bound_last, grads_fwd),
        # the loss's backward: the picked logits' gradient, a zeros tensor and its scatter-add, beside its saved tensors
        (body + head_saved, 2 * head_working, fixed + bound_last, grads_fwd),
        (body, working, fixed + gather_blocks + bound_last, grads_fwd)]
    if pp > 1:
        moments.append((act_stage0, working, fixed + gather_blocks + bound0, grads_fwd))
    # a middle stage holds more blocks than the first and the last where the embedding and the head weigh less than
    # a block, with nearly as many micro-batches in flight as stage 0 and both boundaries: Llama-3 405B at seq 131072,
    # pp 32 (4 blocks there, 3 on the first; measured at real width on fake tensors: 516.5 GiB saved against the 437.8
    # the first and the last stage's moments said, bench/results/real_memory.md)
    for s in range(1, pp - 1):
        moments.append((saved(s), working,
                        fixed + gather_blocks + stage_boundaries(pp, s, m, v, whole), grads_fwd))
    activations = max(x[0] for x in moments)  # the most saved at once (what the measurement compares)
    _, working, buffers, _ = peak_at = max(moments, key=sum)  # the peak moment's transient and buffers
    at_peak = sum(peak_at)
    peak = params_b + optim_b + at_peak
    return {"params": params_b, "grads": grads_b, "optimizer": optim_b, "activations": activations,
            "working": working, "buffers": buffers, "peak": peak}
