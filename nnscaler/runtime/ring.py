"""Ring attention: the partition-aware kernel of context parallelism's ring scheme.

Each rank holds its queries, keys and values for its chunks of the sequence (contiguous, or Llama 3's
balanced pair ``r`` and ``2W-1-r``). Keys and values travel the ring rank to rank by point-to-point
sends (``torch.distributed.batch_isend_irecv``), the next exchange posted before the current block is
computed; each block's scores are merged into the rank's output by online softmax (running max, running
sum, log-sum-exp), as torch's ``context_parallel`` ring and Megatron-LM's p2p context parallelism do.
Masks are read by global positions: a mask comes in with the rank's query rows and every key column,
and each block reads the columns of the chunks it holds; a block every mask hides is skipped. Backward
recomputes each block from the saved log-sum-exp: the queries' gradient stays local, the keys' and
values' gradients travel the ring with their keys and values and end at their owners (one last send).

Why our own loop: torch's ring (``torch.distributed.tensor.experimental._attention``) runs on CUDA
kernels only and takes no additive or document masks, and ``aten._scaled_dot_product_flash_attention``
has no CPU lse for an arbitrary mask; so the block math is plain matmul/exp in float32 (float64 for a
float64 program), with autocast off inside.

``mods``: what the model does to the scores between ``q k^T`` and the softmax, applied per block in
order (literal tuples, so generated code writes them down): ``("mul", c)`` / ``("div", c)`` a scale;
``("add", i)`` add mask input ``i`` (an additive float mask); ``("fill", i, value)`` ``masked_fill``
where mask ``i`` is true; ``("keep", i)`` ``-inf`` where boolean mask ``i`` is false (sdpa's
``attn_mask``); ``("causal",)`` ``-inf`` where the key's global position passes the query's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

NEG = float("-inf")


def pieces(index: int, ranks: int, n: int, balanced: bool) -> list[tuple[int, int]]:
    """``(start, length)`` in the whole sequence of ``n`` of each chunk rank ``index`` holds, in the
    order it holds them: one contiguous chunk, or the balanced pair ``index`` and ``2W-1-index``."""
    if not balanced or ranks == 1:
        c = n // ranks
        return [(index * c, c)]
    c = n // (2 * ranks)
    return [(index * c, c), ((2 * ranks - 1 - index) * c, c)]


def positions(chunks: list[tuple[int, int]], device) -> torch.Tensor:
    return torch.cat([torch.arange(a, a + c, device=device) for a, c in chunks])


def _rows(mask: torch.Tensor, at: int, length: int) -> torch.Tensor:
    """Rows ``at:at+length`` of a mask's query dim (dim -2), whole where it broadcasts (length 1)."""
    return mask if mask.shape[-2] == 1 else mask[..., at:at + length, :]


def _cols(mask: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Columns ``start:start+length`` of a mask's key dim (global positions), whole where it broadcasts."""
    return mask if mask.shape[-1] == 1 else mask[..., start:start + length]


def hidden(mods, masks, qpos: tuple[int, int], kpos: tuple[int, int], row: int) -> bool:
    """Whether some mod hides every score of the block of queries ``qpos`` (local rows from ``row``)
    and keys ``kpos`` (global ``(start, length)``): such a block is skipped."""
    for m in mods:
        if m[0] == "causal" and kpos[0] > qpos[0] + qpos[1] - 1:
            return True
        if m[0] in ("add", "fill", "keep"):
            blk = _cols(_rows(masks[m[1]], row, qpos[1]), *kpos)
            if m[0] == "add" and blk.is_floating_point() and bool((blk <= torch.finfo(blk.dtype).min).all()):
                return True
            if m[0] == "fill" and (m[2] == NEG or m[2] <= -1e30) and bool(blk.all()):
                return True
            if m[0] == "keep" and not bool(blk.any()):
                return True
    return False


def scores(q, k, mods, masks, qpos, kpos, row):
    """The block's scores after the model's mods (``q`` rows ``qpos``, ``k`` keys at global ``kpos``)."""
    s = q @ k.transpose(-1, -2)
    for m in mods:
        if m[0] == "mul":
            s = s * m[1]
        elif m[0] == "div":
            s = s / m[1]
        elif m[0] == "causal":
            i = torch.arange(qpos[0], qpos[0] + qpos[1], device=s.device)[:, None]
            j = torch.arange(kpos[0], kpos[0] + kpos[1], device=s.device)[None, :]
            s = s.masked_fill(j > i, NEG)
        else:
            blk = _cols(_rows(masks[m[1]], row, qpos[1]), *kpos)
            if m[0] == "add":
                s = s + blk.to(s.dtype)
            elif m[0] == "fill":
                s = s.masked_fill(blk, m[2])
            elif m[0] == "keep":
                s = s.masked_fill(~blk, NEG)
            else:
                raise ValueError(f"ring attention: unknown score mod {m!r}")
    return s


def scale_of(mods) -> float:
    """The product of the mods' scales: the factor from ``d scores`` back to ``d (q k^T)``."""
    out = 1.0
    for m in mods:
        out = out * m[1] if m[0] == "mul" else out / m[1] if m[0] == "div" else out
    return out


class Ring:
    """The ring of one process group: sends to the next rank, receives from the previous one."""

    def __init__(self, group):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def post(self, tensors: list[torch.Tensor], tag: int) -> tuple[list, list[torch.Tensor]]:
        """Send ``tensors`` to the next rank and receive as many from the previous; returns the
        pending requests and the receive buffers (valid after :meth:`wait`)."""
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        tensors = [t.contiguous() for t in tensors]  # gloo sends and receives dense buffers
        bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt, tag=tag + i)
               for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, b, group=self.group, group_peer=prv, tag=tag + i) for i, b in enumerate(bufs)]
        return dist.batch_isend_irecv(ops), bufs

    @staticmethod
    def wait(reqs) -> None:
        for r in reqs:
            r.wait()


def _rep(x: torch.Tensor, g: int) -> torch.Tensor:
    """Grouped-query attention: each key head read by ``g`` query heads in a row (sdpa's ``enable_gqa``),
    expanded per block so that the ring carries the compact keys."""
    return x if g == 1 else x.repeat_interleave(g, dim=-3)


def _fold(x: torch.Tensor, g: int) -> torch.Tensor:
    """The gradient of :func:`_rep`: the ``g`` query heads' shares summed to their key head."""
    return x if g == 1 else x.unflatten(-3, (-1, g)).sum(-2)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def merge(m, l, acc, s, v):
    """One block into the online softmax of its query rows: running max ``m``, running sum ``l`` and
    the unnormalised output ``acc`` rescaled to the new max, the block's ``exp(s - max) v`` added."""
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # rows masked so far stay -inf
    p = torch.exp(s - shift)
    alpha = torch.exp(m - shift)
    return m_new, l * alpha + p.sum(-1, keepdim=True), acc * alpha + p @ v


def pass_grads(ring: Ring, grads: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """After ring step ``step``: the key/value gradients accumulated for the keys held move on with
    them to the next rank; after the last step that send ends at the keys' owner."""
    if ring.size == 1:
        return grads
    reqs, got = ring.post(grads, 30)
    Ring.wait(reqs)
    return got


class RingAttention(torch.autograd.Function):
    """softmax(mods(q k^T)) v over the ring; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, ring, chunks_of, mods, *masks):
        cd = _compute_dtype(q)
        out_dtype, g = q.dtype, q.shape[-3] // k.shape[-3]
        with torch.autocast(q.device.type, enabled=False):
            qc = q.to(cd)  # keys and values travel in their own dtype (bf16 under bf16-mixed), blocks compute in cd
            mine = chunks_of(ring.rank)
            rows = [sum(c for _, c in mine[:i]) for i in range(len(mine))]
            shape = qc.shape[:-1] + (1,)
            m = torch.full(shape, NEG, dtype=cd, device=q.device)
            l = torch.zeros(shape, dtype=cd, device=q.device)
            acc = torch.zeros(qc.shape[:-1] + (v.shape[-1],), dtype=cd, device=q.device)
            cur = [k, v]
            for step in range(ring.size):
                src = (ring.rank - step) % ring.size
                reqs, nxt = ring.post(cur, 10) if step < ring.size - 1 else ([], None)  # next exchange first
                theirs = chunks_of(src)
                at = 0
                for kp in theirs:
                    kb, vb = (_rep(x[..., at:at + kp[1], :].to(cd), g) for x in cur)
                    at += kp[1]
                    for qp, row in zip(mine, rows):
                        if hidden(mods, masks, qp, kp, row):
                            continue
                        s = scores(qc[..., row:row + qp[1], :], kb, mods, masks, qp, kp, row)
                        sl = slice(row, row + qp[1])
                        m[..., sl, :], l[..., sl, :], acc[..., sl, :] = merge(
                            m[..., sl, :], l[..., sl, :], acc[..., sl, :], s, vb)
                Ring.wait(reqs)
                cur = nxt if nxt is not None else cur
            out = acc / l
            lse = torch.where(torch.isfinite(m), m, torch.zeros_like(m)) + torch.log(l)
        res = out.to(out_dtype)
        # what a flash kernel keeps: the queries as they came and the output as returned (the tensors the program
        # holds anyway, so nothing is kept twice: recompute="full-except-core" keeps exactly these), recast in
        # backward; the output's row sums there read its rounding as FlashAttention's bf16 output does
        ctx.save_for_backward(q, k, v, res, lse, *masks)
        ctx.ring, ctx.chunks_of, ctx.mods, ctx.dtypes, ctx.g = ring, chunks_of, mods, (q.dtype, k.dtype, v.dtype), g
        return res

    @staticmethod
    def backward(ctx, dout):
        q, k, v, res, lse, *masks = ctx.saved_tensors
        ring, chunks_of, mods, g = ctx.ring, ctx.chunks_of, ctx.mods, ctx.g
        scale = scale_of(mods)
        with torch.autocast(q.device.type, enabled=False):
            qc, out = q.to(_compute_dtype(q)), res.to(_compute_dtype(q))
            do = dout.to(qc.dtype)
            delta = (do * out).sum(-1, keepdim=True)
            mine = chunks_of(ring.rank)
            rows = [sum(c for _, c in mine[:i]) for i in range(len(mine))]
            dq = torch.zeros_like(qc)
            cur = [k, v]
            # dK, dV of the keys held, accumulated in cd: they travel with them
            grads = [torch.zeros_like(k, dtype=qc.dtype), torch.zeros_like(v, dtype=qc.dtype)]
            for step in range(ring.size):
                src = (ring.rank - step) % ring.size
                reqs, nxt = ring.post(cur, 20) if step < ring.size - 1 else ([], None)
                at = 0
                for kp in chunks_of(src):
                    ks = slice(at, at + kp[1])
                    kb, vb = (_rep(x[..., ks, :].to(qc.dtype), g) for x in cur)
                    at += kp[1]
                    for qp, row in zip(mine, rows):
                        if hidden(mods, masks, qp, kp, row):
                            continue
                        sl = slice(row, row + qp[1])
                        qb = qc[..., sl, :]
                        s = scores(qb, kb, mods, masks, qp, kp, row)
                        p = torch.exp(s - lse[..., sl, :])
                        grads[1][..., ks, :] += _fold(p.transpose(-1, -2) @ do[..., sl, :], g)
                        ds = p * (do[..., sl, :] @ vb.transpose(-1, -2) - delta[..., sl, :]) * scale
                        dq[..., sl, :] += ds @ kb
                        grads[0][..., ks, :] += _fold(ds.transpose(-1, -2) @ qb, g)
                Ring.wait(reqs)
                grads = pass_grads(ring, grads, step)
                cur = nxt if nxt is not None else cur
        dq_t, dk_t, dv_t = ctx.dtypes
        return (dq.to(dq_t), grads[0].to(dk_t), grads[1].to(dv_t), None, None, None) + (None,) * len(masks)


class Chunks:
    """``rank -> [(start, length)]`` of a sequence of ``n`` over ``ranks`` (plain data, picklable)."""

    def __init__(self, ranks: int, n: int, balanced: bool):
        self.ranks, self.n, self.balanced = ranks, n, balanced

    def __call__(self, index: int) -> list[tuple[int, int]]:
        return pieces(index, self.ranks, self.n, self.balanced)


def autocast_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``xs`` as ``torch.autocast`` hands them to the attention this kernel stands for (sdpa is on its
    lower-precision list: floating inputs cast to the autocast dtype, so the output comes out in it too);
    as they are outside autocast. A ``torch.autograd.Function`` gets no autocast casts of its own."""
    dev = xs[0].device.type
    if not torch.is_autocast_enabled(dev):
        return xs
    dt = torch.get_autocast_dtype(dev)
    return tuple(x.to(dt) if x.is_floating_point() else x for x in xs)


def ring_attention(shard, q, k, v, *masks, ident: str = "s", mods=(), keys_transposed: bool = False):
    """Attention of this rank's queries over every key, keys and values exchanged on the ring of the
    ranks that split ``ident`` (the sequence); ``k`` is ``k^T`` (keys last) when ``keys_transposed``.
    Works unsplit too (one rank: plain attention in blocks of one)."""
    if keys_transposed:
        k = k.transpose(-1, -2)
    q, k, v = autocast_inputs(q, k, v)
    ring = Ring(shard.group(ident))
    balanced = ident in getattr(shard, "balanced", ())
    chunks = Chunks(ring.size, shard.full(ident), balanced)
    masks = tuple(x.detach() for x in masks)
    return RingAttention.apply(q, k, v, ring, chunks, tuple(mods), *masks)


def attention(q, k, v, *masks, mods=(), keys_transposed: bool = False):
    """The same attention on one device (the operator's unsplit meaning), with ``math`` only."""
    if keys_transposed:
        k = k.transpose(-1, -2)
    q, k, v = autocast_inputs(q, k, v)
    n, g = k.shape[-2], q.shape[-3] // k.shape[-3]
    s = scores(q, _rep(k, g), mods, masks, (0, q.shape[-2]), (0, n), 0)
    return (torch.softmax(s, -1, dtype=_compute_dtype(q)).to(q.dtype) @ _rep(v, g))

