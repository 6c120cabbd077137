"""Compile time (trace + plan + generate) of a 12-layer, width-768 GPT-shaped model, per policy.

    python bench/perf/compile_time.py [--layers 12] [--width 768] [--world-size 2]

Prints seconds per stage; the baseline in the same run is ``torch.export`` alone (tracing is the
part nnscaler delegates), so the ratio shows what planning and code generation add.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

import opzoo  # noqa: F401
from nnscaler.codegen.emit import generate
from nnscaler.policies import POLICIES, ComputeConfig
from nnscaler.trace.build import UnknownOperatorWarning, trace
from verify.models.nanogpt import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    warnings.simplefilter("ignore", UnknownOperatorWarning)
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 64))
    torch.export.export(model, (idx, idx), strict=False)  # warm-up: the first export pays one-off costs
    t0 = time.perf_counter()
    torch.export.export(model, (idx, idx), strict=False)
    t_export = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = trace(model, (idx, idx))
    t_trace = time.perf_counter() - t0
    print(f"GPT {args.layers} layers x {args.width}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"{len(graph.ops)} operators; torch.export alone {t_export:.2f} s, trace {t_trace:.2f} s")
    for name, policy in POLICIES.items():
        config = ComputeConfig(args.world_size, tp_size=2 if args.world_size % 2 == 0 else 1)
        t0 = time.perf_counter()
        plan = policy(graph, config)
        t_plan = time.perf_counter() - t0
        t0 = time.perf_counter()
        for rank in range(args.world_size):
            generate(graph, plan, rank)
        t_gen = time.perf_counter() - t0
        total = t_trace + t_plan + t_gen
        print(f"  {name:<7} plan {t_plan:6.2f} s  generate {t_gen:6.2f} s ({args.world_size} ranks)  "
              f"compile total {total:6.2f} s = {total / t_export:.2f}x torch.export alone")


if __name__ == "__main__":
    main()
