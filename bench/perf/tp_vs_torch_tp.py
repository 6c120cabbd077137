"""Train-step time of nnscaler's ``tp`` against PyTorch's own tensor parallelism
(``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``: the plan a user writes by
hand), world size 2 on gloo, the same GPT and batch, in the same processes (alternating rounds, so
machine noise hits both alike).

    python bench/perf/tp_vs_torch_tp.py [--layers 4] [--width 256] [--batch 8] [--seq 64] [--steps 5]

The GPT has separate q, k and v projections and reads its local head count from their output, so
the hand plan needs no model change (PyTorch's column split of a fused qkv would mix q and k).
Hand plan: q, k, v, MLP up column-split; attention and MLP out row-split; the word embedding
row-split (vocabulary), the LM head column-split with its logits gathered; norms and position
embedding whole. Goal: ratio (nnscaler / PyTorch) <= 1.0.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.c_fc, self.c_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, width: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def torch_tp(model: GPT, layers: int):
    """PyTorch's tensor parallelism, planned by hand as its tutorial does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(layers):
        plan.update({f"h.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update({f"h.{i}.attn.proj": RowwiseParallel(), f"h.{i}.c_fc": ColwiseParallel(),
                     f"h.{i}.c_proj": RowwiseParallel()})
    return parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), plan)


def _steps(module, opt, batch, n: int) -> tuple[float, float]:
    times, loss = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        loss = module(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), float(loss)


def _rank(rank: int, world: int, args) -> dict:
    import opzoo  # noqa: F401
    from nnscaler import ComputeConfig, parallelize

    shape = (args.vocab, args.seq, args.layers, args.width, args.width // 64)
    torch.manual_seed(0)
    base = GPT(*shape)
    theirs = GPT(*shape)
    theirs.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(2))
    with tempfile.TemporaryDirectory() as d:
        ours = parallelize(base, batch, "tp", ComputeConfig(world), gen_savedir=d)
    theirs = torch_tp(theirs, args.layers)
    opts = {"torch": torch.optim.AdamW(theirs.parameters(), foreach=False),
            "nnscaler": torch.optim.AdamW(ours.parameters(), foreach=False)}
    models = {"torch": theirs, "nnscaler": ours}
    losses = {k: _steps(models[k], opts[k], batch, 2)[1] for k in models}  # warm up; same first losses
    results = {k: [] for k in models}
    for _ in range(args.rounds):
        for k in models:
            results[k].append(_steps(models[k], opts[k], batch, args.steps)[0])
    return {"losses": losses, **{k: statistics.median(v) for k, v in results.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from verify.runner.spawn import run_ranks
    r = run_ranks(_rank, 2, args, timeout_s=3600)[0]
    la, lb = r["losses"]["nnscaler"], r["losses"]["torch"]
    print(f"GPT {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x{args.seq}, world size 2 (gloo, CPU): "
          f"PyTorch TP {r['torch'] * 1e3:.1f} ms/step, nnscaler tp {r['nnscaler'] * 1e3:.1f} ms/step, "
          f"ratio {r['nnscaler'] / r['torch']:.3f} (goal <= 1.0); loss after 2 steps {la:.5f} vs {lb:.5f}")


if __name__ == "__main__":
    main()
