"""Collectives the ``tp`` plan issues per transformer layer, against Megatron-LM's 2 all-reduces
forward and 2 backward, and the share of each layer's parameters stored split, per model.

    python bench/studies/tp_collectives.py [--world-size 2] [--width 64] [--models nanogpt gpt2 llama bert t5]
    python bench/studies/tp_collectives.py --world-size 4 --tp-size 2 --sequence-parallel   # hybrid (dp x tp) + SP

Per layer = (count with 2 layers) - (count with 1 layer), from the steps of the generated program;
backward collectives are those the forward steps imply for tensors that carry a gradient. Activations'
collectives are counted; the last column counts the gradient sums of weights kept whole that the
program issues per use (under hybrid + sequence parallelism a norm's weight is summed over both mesh
axes; on one axis it rides in the gradient buckets instead). Models
come from ``verify/models/megatron.py`` (head counts divisible by the world size). T5 runs without
labels (decoder inputs given), so it needs no lifted constants; one T5 "layer" is an encoder layer
plus a decoder layer (Megatron: 2 + 3 all-reduces), and its shared relative-position bias, kept
whole, is split by heads at each use (an all-gather of its gradient in backward).
"""
from __future__ import annotations

import argparse
import warnings

import opzoo  # noqa: F401
from nnscaler.policies import POLICIES, ComputeConfig
from nnscaler.policies.tp_check import collectives, sharded_fraction
from nnscaler.trace.build import UnknownOperatorWarning, trace
from verify.models.megatron import TP_MODELS


def per_layer(name: str, world: int, width: int, policy: str = "tp", **config):
    """(forward per layer, backward per layer, sharded fraction, bytes held per rank / whole) of
    one model's plan."""
    out = []
    for layers in (1, 2):
        case = TP_MODELS[name](layers=layers, width=width)
        graph = trace(case.model, case.batch(0))
        plan = POLICIES[policy](graph, ComputeConfig(world, **config))
        out.append((*collectives(graph, plan, params=False), sharded_fraction(graph, plan),
                    sum(collectives(graph, plan)[1].values()) - sum(collectives(graph, plan, params=False)[1].values())))
    (f1, b1, _, p1), (f2, b2, frac, p2) = out
    return f2 - f1, b2 - b1, frac, p2 - p1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--models", nargs="+", default=list(TP_MODELS))
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--tp-size", type=int, default=None,
                    help="plan with hybrid (dp x tp) at this tp degree instead of tp over every rank")
    args = ap.parse_args()
    warnings.simplefilter("ignore", UnknownOperatorWarning)
    w = args.world_size
    extra = {"sequence_parallel": True} if args.sequence_parallel else {}
    policy = "tp"
    if args.tp_size is not None:
        policy, extra["tp_size"] = "hybrid", args.tp_size
        w = args.tp_size  # the per-layer collectives run over the tp axis; the goals are those of tp at that degree
    print(f"{policy} plan, world size {args.world_size}{f' (dp {args.world_size // w} x tp {w})' if policy == 'hybrid' else ''}, "
          f"width {args.width}{', sequence parallel' if args.sequence_parallel else ''}; per transformer "
          f"layer (Megatron: {'2 all_gather + 2 reduce_scatter' if extra else '2 all_reduce'} forward and backward)")
    print(f"{'model':8} {'forward':34} {'backward':34} {'split':>6} {'held/rank':>9} (goal >= {1 - 1 / w:.2f}, <= {1 / w:.2f}) weight-grad sums")
    for name in args.models:
        try:
            fwd, bwd, (split, held), wgrads = per_layer(name, args.world_size, args.width, policy, **extra)
        except Exception as exc:  # one model failing to trace or plan is a row, not the end
            print(f"{name:8} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            continue
        f = f"{sum(fwd.values())} {dict(sorted(fwd.items()))}"
        b = f"{sum(bwd.values())} {dict(sorted(bwd.items()))}"
        print(f"{name:8} {f:34} {b:34} {split:6.2f} {held:9.2f} {wgrads:6}")


if __name__ == "__main__":
    main()
