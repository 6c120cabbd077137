"""Saved activations under ``recompute`` none / full / selective / full-except-core on a 4-layer nanoGPT (one rank, gloo),
measured with ``torch.autograd.graph.saved_tensors_hooks`` (:class:`nnscaler.runtime.recompute.SavedActivations`),
and whether the gradients stay identical. ``python bench/perf/recompute.py [--layers 4] [--width 64] [--json]``
prints one line per mode with the bytes and the ratio against ``none``."""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist

from nnscaler import ComputeConfig, parallelize
from nnscaler.runtime.recompute import SavedActivations
from verify.models.nanogpt import GPT, GPTConfig


def measure(layers: int = 4, width: int = 64, seq: int = 32, batch: int = 8, modes=("none", "full", "selective", "full-except-core"),
            policy: str = "dp") -> dict:
    """``{mode: {"bytes": saved bytes, "grads_equal": bool}}`` (gradients compared with ``none``'s)."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=seq, n_layer=layers, n_head=4, n_embd=width))
    g = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 64, (batch, seq), generator=g) for _ in range(2))
    out, base = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            pm = parallelize(copy.deepcopy(model), (idx, targets), policy, ComputeConfig(1, recompute=mode),
                             gen_savedir=os.path.join(tmp, mode), verify=False)
            with SavedActivations(list(pm.parameters()) + list(pm.buffers())) as saved:
                loss = pm(idx, targets)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
            base = grads if base is None else base
            out[mode] = {"bytes": saved.bytes, "loss": float(loss.detach()),
                         "grads_equal": all(torch.equal(grads[n], base[n]) for n in base)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = measure(args.layers, args.width)
    if args.json:
        print(json.dumps(res))
        return
    none = res["none"]["bytes"]
    for mode, r in res.items():
        print(f"recompute={mode:9s} saved activations {r['bytes'] / 1024:9.1f} KiB  "
              f"ratio none/this {none / r['bytes']:5.2f}x  gradients identical: {r['grads_equal']}")


if __name__ == "__main__":
    main()
