"""Collectives the ``tp`` plan issues per transformer layer, counted from the generated code, against
Megatron's 2 all-reduces forward and 2 backward per layer.

    python bench/tp_collectives.py [--width 768] [--world-size 2]

Per layer = (count with 2 layers) - (count with 1 layer). Backward collectives are those the
forward steps imply: ``grad_all_reduce`` and ``split`` (all-reduce / all-gather of the gradient),
``reduce_scatter`` (all-gather), ``all_to_all`` (all-to-all).
"""
from __future__ import annotations

import argparse
import re
import warnings
from collections import Counter

import torch

import opzoo  # noqa: F401
from nnscaler.codegen.emit import generate
from nnscaler.policies import POLICIES, ComputeConfig
from nnscaler.trace.build import UnknownOperatorWarning, trace
from verify.models.nanogpt import GPT, GPTConfig

FORWARD = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
BACKWARD = {"grad_all_reduce": "all_reduce", "split": "all_gather", "reduce_scatter": "all_gather",
            "all_to_all": "all_to_all"}


def count(layers: int, width: int, world: int) -> tuple[Counter, Counter, str]:
    cfg = GPTConfig(vocab_size=50304, block_size=128, n_layer=layers, n_head=width // 64, n_embd=width)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 64))
    graph = trace(model, (idx, idx))
    plan = POLICIES["tp"](graph, ComputeConfig(world))
    source, _, _ = generate(graph, plan, 0)
    steps = re.findall(r"= C\.(\w+)\(", source)
    fwd = Counter(s for s in steps if s in FORWARD)
    bwd = Counter(BACKWARD[s] for s in steps if s in BACKWARD)
    return fwd, bwd, source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    warnings.simplefilter("ignore", UnknownOperatorWarning)
    f1, b1, _ = count(1, args.width, args.world_size)
    f2, b2, _ = count(2, args.width, args.world_size)
    fwd, bwd = f2 - f1, b2 - b1
    print(f"tp plan, width {args.width}, world size {args.world_size}, per transformer layer:")
    print(f"  forward : {sum(fwd.values())} collectives {dict(fwd)}  (Megatron: 2 all_reduce)")
    print(f"  backward: {sum(bwd.values())} collectives {dict(bwd)}  (Megatron: 2 all_reduce)")


if __name__ == "__main__":
    main()
