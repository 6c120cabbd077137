"""Measure achieved bf16 throughput of the kernels a transformer step spends its time in, on the GPU
this runs on: the GEMMs of Llama-shaped layers (tokens x hidden -> projections, at tensor-parallel
degrees 1-8) and causal flash attention, forward and backward. Writes a CSV (``--out``) that
``nnscaler/cost`` profiles are calibrated against; needs CUDA (exits 2 without it).

    python bench/calibration/gpu_kernels.py --out bench/results/h100_kernels.csv
"""
from __future__ import annotations

import argparse
import csv
import sys

import torch
import torch.nn.functional as F

# (model, hidden, ffn, heads, kv_heads) of Llama 3 8B / 70B / 405B
SHAPES = [("8B", 4096, 14336, 32, 8), ("70B", 8192, 28672, 64, 8), ("405B", 16384, 53248, 128, 8)]


def _time(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def gemms(tokens: int):
    for model, h, ffn, heads, kv in SHAPES:
        hd = h // heads
        for tp in (1, 2, 4, 8):
            for name, k, n in (("qkv", h, (heads + 2 * kv) * hd // tp), ("proj", h // tp, h),
                               ("fc1", h, 2 * ffn // tp), ("fc2", ffn // tp, h)):
                a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                fwd = _time(lambda: F.linear(a, w))
                yield dict(kind="gemm", model=model, tp=tp, op=name, m=tokens, k=k, n=n,
                           seconds=fwd, tflops=2 * tokens * k * n / fwd / 1e12)


def attention(seq: int):
    for model, h, ffn, heads, kv in SHAPES:
        hd = h // heads
        for tp in (1, 8):
            nh = heads // tp
            q, k_, v = (torch.randn(1, nh, seq, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                        for _ in range(3))
            out = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
            grad = torch.randn_like(out)
            fwd = _time(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True))
            both = _time(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k_, v, is_causal=True),
                                                     (q, k_, v), grad))
            flops = 4 * seq * seq * hd * nh / 2  # causal: half the score matrix
            yield dict(kind="attention", model=model, tp=tp, op="sdpa_fwd", m=seq, k=hd, n=nh, seconds=fwd,
                       tflops=flops / fwd / 1e12)
            yield dict(kind="attention", model=model, tp=tp, op="sdpa_fwd_bwd", m=seq, k=hd, n=nh, seconds=both,
                       tflops=3.5 * flops / both / 1e12)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/calibration/gpu_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [r for t in args.tokens for r in gemms(t)] + [r for s in (4096, 8192) for r in attention(s)]
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    peak = max(r["tflops"] for r in rows)
    print(f"{torch.cuda.get_device_name()}: {len(rows)} kernels, best {peak:.0f} TFLOP/s; wrote {args.out}")
    for r in rows:
        if r["kind"] == "attention" or (r["tp"] in (1, 8) and r["m"] == 4096):
            print(f"{r['kind']:9} {r['model']:4} tp{r['tp']} {r['op']:12} m={r['m']:5} k={r['k']:5} n={r['n']:6} "
                  f"{r['tflops']:6.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
