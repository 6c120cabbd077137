"""The generated program on one GPU, against plain PyTorch and against the planner's estimates; writes
``bench/results/gpu_<device>.md`` (issue #38, item 5). At most ~8 minutes on one H100/H200.

    python bench/gpu_check.py [--out FILE] [--steps 10] [--seq 4096] [--layers 2]

(a) A Llama-3-8B-shaped block stack at reduced depth (hidden 4096, ffn 14336, 32 heads / 8 kv heads,
    vocab 128256, ``--layers`` blocks), bf16-mixed, one sequence of ``--seq`` tokens: the model in plain
    PyTorch (``torch.autocast``, AdamW) and the compiled program of a 1-rank plan (``dp`` on one rank),
    same weights and batch: step time, throughput ratio (plain / compiled; goal >= 0.95) and MFU (the
    cluster cost model's FLOP count over the measured step, at the profile's bf16 peak).
(b) Rank 0's program of a tp x dp plan with ZeRO 1 (``--world`` ranks, tp 4) at real width on a fake
    process group (``torch.distributed`` backend ``"fake"``: collectives return at once, so the step is
    the rank's compute): step time against the cost model's compute term, and peak memory
    (``torch.cuda.max_memory_allocated``) against the planner's estimate; then the same with 2 pipeline
    stages (tp 4 x pp 2), reported as an error line if the pipeline runtime cannot run on a fake group.
(c) The GPU-only tests: test files under ``tests/`` that skip without CUDA (none today: said so).

Without a CUDA device it prints one line saying it skipped and why, writes nothing and exits 0.
Each part runs in its own process (its own CUDA memory and process group). ``--cpu-smoke`` runs the
same code paths on the CPU at toy size (to check the script itself where no GPU is lent).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2 ** 30
LLAMA3_8B = dict(hidden=4096, ffn=14336, heads=32, kv=8, vocab=128256)
SMOKE = dict(hidden=64, ffn=128, heads=8, kv=4, vocab=256)
PART_TIMEOUT = 200  # seconds per part at most
BUDGET = 470  # seconds for the whole check: every part's limit is cut to what is left (8 minutes in all)


def _shape(args) -> dict:
    return {**(SMOKE if args.cpu_smoke else LLAMA3_8B), "layers": args.layers, "seq": args.seq}


def _llama(s: dict, device):
    import opzoo  # noqa: F401  (the operator annotations)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from verify.models.common import LossOf
    torch.manual_seed(0)
    with torch.device(device):
        return LossOf(LlamaForCausalLM(LlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"], num_key_value_heads=s["kv"], max_position_embeddings=s["seq"],
            attn_implementation="sdpa", use_cache=False)))


def _batch(s: dict, n: int, device):
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s["vocab"], (n, s["seq"]), generator=g).to(device)
    return ids, ids


def _estimate(s: dict, world: int, constraints: dict, batch: int, profile: str):
    """``(plan, config)``: the cluster cost model's estimate of exactly ``constraints`` (every key fixed),
    a cluster-scale autodist plan of the meta model."""
    import torch

    from nnscaler import ComputeConfig, plan_model
    full = {"micro_batch_size": 1, "virtual_stages": 1, "sequence_parallel": False, "recompute": "none", "cp": 1,
            **constraints}
    full["num_microbatches"] = batch // (full["dp"] * full["micro_batch_size"])
    config = ComputeConfig(world, profile=profile, precision="bf16-mixed", global_batch=batch, constraints=full)
    ids = torch.zeros(1, s["seq"], dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model(_llama(s, "meta"), (ids, ids), "autodist", config), config


def _timed_steps(step, steps: int, sync) -> list[float]:
    for _ in range(3):  # warm up: allocator, kernels, the optimizer's state
        step()
    sync()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _fake_group(world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _device(args):
    import torch
    return torch.device("cpu" if args.cpu_smoke else "cuda")


def _sync(device):
    import torch
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _profile_name() -> str:
    return "h100"  # the only Hopper profile (nnscaler/profiles.py); an H200 has the same bf16 peak


def part_a(args) -> dict:
    """Plain PyTorch against the compiled 1-rank program, same model, weights and batch."""
    import torch

    from nnscaler import ComputeConfig, parallelize
    dev, s = _device(args), _shape(args)
    sync = _sync(dev)
    est, _ = _estimate(s, 1, {"tp": 1, "pp": 1, "dp": 1, "zero": 0}, 1, _profile_name())
    model = _llama(s, dev)
    batch = _batch(s, 1, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def plain():
        with torch.autocast(dev.type, torch.bfloat16):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_plain = _timed_steps(plain, args.steps, sync)
    del opt
    model.zero_grad(set_to_none=True)
    gc.collect()
    _fake_group(1)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        pm = parallelize(model, batch, "dp", ComputeConfig(1, precision="bf16-mixed", profile=_profile_name()),
                         gen_savedir=d, verify=False)
        compile_s = time.perf_counter() - t0
    popt = pm.build_optimizer(torch.optim.AdamW, lr=1e-5)

    def compiled():
        pm.train_step(*batch)
        popt.step()
        popt.zero_grad(set_to_none=True)

    t_comp = _timed_steps(compiled, args.steps, sync)
    cl = est.stats.cluster.best
    flops_s = cl.mfu * cl.step_seconds  # the model FLOPs of one step / peak FLOP/s (the cost model's count)
    plain_s, comp_s = statistics.median(t_plain), statistics.median(t_comp)
    return {"shape": s, "plain_s": plain_s, "compiled_s": comp_s, "ratio": plain_s / comp_s,
            "mfu_plain": flops_s / plain_s, "mfu_compiled": flops_s / comp_s, "estimate_s": cl.step_seconds,
            "estimate_mfu": cl.mfu, "compile_s": compile_s, "tokens": s["seq"]}


def part_b(args) -> dict:
    """Rank 0's program of a tp x (pp x) dp ZeRO-1 plan on a fake group: step and peak vs the estimate."""
    import torch

    from nnscaler import parallelize
    from nnscaler.cluster.autodist import lowered
    dev, s = _device(args), _shape(args)
    sync = _sync(dev)
    tp, pp = 4, args.pp
    dp = args.world // (tp * pp)
    batch_n = dp * pp  # pp micro-batches per dp rank keep 1F1B's stages busy
    est, config = _estimate(s, args.world, {"tp": tp, "pp": pp, "dp": dp, "zero": 1}, batch_n, _profile_name())
    cl = est.stats.cluster.best
    policy, cfg = lowered(est, config)
    _fake_group(args.world)
    model = _llama(s, dev)
    batch = _batch(s, batch_n, dev)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(model, batch, policy, cfg, gen_savedir=d, verify=False)
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    built = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    opt = pm.build_optimizer(torch.optim.AdamW, lr=1e-5)

    def step():
        pm.train_step(*batch)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = _timed_steps(step, args.steps, sync)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    return {"parallel": cl.parallel.as_dict(), "policy": policy, "step_s": statistics.median(times),
            "compute_s": cl.time["compute"], "optimizer_s": cl.time["optimizer"], "recompute_s": cl.time["recompute"],
            "estimate_total_s": cl.step_seconds, "peak_bytes": peak, "built_bytes": built,
            "estimate_peak_bytes": cl.memory["peak"], "estimate_memory": dict(cl.memory)}


def gpu_tests() -> list[Path]:
    """Test files that skip without CUDA (``skipif(not torch.cuda.is_available(), ...)``)."""
    pattern = re.compile(r"skipif\(\s*not\s+(torch\.)?cuda\.is_available\(\)|requires_cuda|needs_cuda")
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if pattern.search(p.read_text()))


def run_part(name: str, args, extra: list[str], left: float) -> dict:
    """Part ``name`` in its own process, given at most ``left`` seconds; its JSON, or ``{"error": ...}``."""
    limit = min(PART_TIMEOUT, left)
    if limit < 20:
        return {"error": f"not run: {left:.0f} s of the {BUDGET} s budget left"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--part", name, "--json", out, "--steps", str(args.steps), "--seq", str(args.seq),
           "--layers", str(args.layers), "--world", str(args.world), *extra, *(["--cpu-smoke"] if args.cpu_smoke else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {limit:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"error": f"exit {done.returncode}: {tail[0][:300]}"}
    return json.loads(Path(out).read_text())


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def markdown(device: str, a: dict, bs: list[dict], tests: dict, seconds: float) -> str:
    lines = [f"# The generated program on {device}", "",
             f"`python bench/gpu_check.py` ({seconds:.0f} s). Profile `h100` (bf16 peak 989 TFLOP/s).", "",
             "## (a) One rank: plain PyTorch vs the compiled 1-rank plan (bf16-mixed, AdamW)", ""]
    if "error" in a:
        lines.append(f"error: {a['error']}")
    else:
        s = a["shape"]
        lines += [f"Llama-3-8B-shaped: {s['layers']} blocks, hidden {s['hidden']}, ffn {s['ffn']}, {s['heads']} heads / "
                  f"{s['kv']} kv heads, vocab {s['vocab']}, 1 x {s['seq']} tokens; compile {a['compile_s']:.1f} s.", "",
                  "| run | step (median) | tokens/s | MFU |", "|---|---|---|---|",
                  f"| plain PyTorch | {1e3 * a['plain_s']:.1f} ms | {a['tokens'] / a['plain_s']:.0f} | {100 * a['mfu_plain']:.1f}% |",
                  f"| compiled (1-rank dp plan) | {1e3 * a['compiled_s']:.1f} ms | {a['tokens'] / a['compiled_s']:.0f} | "
                  f"{100 * a['mfu_compiled']:.1f}% |",
                  f"| cost model estimate | {1e3 * a['estimate_s']:.1f} ms | {a['tokens'] / a['estimate_s']:.0f} | "
                  f"{100 * a['estimate_mfu']:.1f}% |", "",
                  f"Throughput ratio compiled / plain: **{a['ratio']:.3f}** (goal >= 0.95)."]
    lines += ["", "## (b) Rank 0 of a multi-rank plan at real width, fake process group", "",
              "| plan | step (measured) | compute term (+optimizer) | ratio | peak (measured) | peak (estimate) | ratio |",
              "|---|---|---|---|---|---|---|"]
    for b in bs:
        if "error" in b:
            lines.append(f"| {b.get('label', '?')} | error: {b['error']} | | | | | |")
            continue
        p = b["parallel"]
        label = f"tp {p['tp']} x pp {p['pp']} x dp {p['dp']}, zero {p['zero']} ({b['policy']})"
        model_s = b["compute_s"] + b["optimizer_s"] + b["recompute_s"]
        peak = b["peak_bytes"]
        lines.append(f"| {label} | {1e3 * b['step_s']:.1f} ms | {1e3 * model_s:.1f} ms | {b['step_s'] / model_s:.2f} | "
                     f"{_gib(peak)} (built: {_gib(b['built_bytes'])}) | {_gib(b['estimate_peak_bytes'])} | "
                     f"{peak / b['estimate_peak_bytes'] if b['estimate_peak_bytes'] else float('nan'):.2f} |")
    lines += ["", "Collectives on the fake group return at once: the measured step is the rank's compute, held "
              "against the cost model's compute term (a pipeline stage that receives from its neighbour gets "
              "uninitialised data from a fake group: an error on the pp row says the runtime could not run so). "
              "Peak: `torch.cuda.max_memory_allocated` from after the build "
              "(the single-device model deleted) through the measured steps.", "",
              "## (c) GPU-only tests", "", tests["line"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the Markdown file (default bench/results/gpu_<device>.md)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per run (after 3 warm-up steps)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2, help="blocks of the 8B-shaped stack (8B has 32)")
    ap.add_argument("--world", type=int, default=8, help="ranks of part (b)'s plan")
    ap.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=("a", "b"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU: checks the script, measures nothing")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available() and not args.cpu_smoke:
        why = "this torch has no CUDA" if torch.version.cuda is None else "torch.cuda.is_available() is False"
        print(f"gpu_check: skipped: no CUDA device ({why}); nothing measured, nothing written")
        return 0
    if args.part:
        result = (part_a if args.part == "a" else part_b)(args)
        Path(args.json).write_text(json.dumps(result))
        return 0
    start = time.perf_counter()
    device = "cpu-smoke" if args.cpu_smoke else torch.cuda.get_device_name(0)
    a = run_part("a", args, [], BUDGET - (time.perf_counter() - start))
    print("(a)", json.dumps(a), flush=True)
    bs = []
    for pp in (1, 2):
        b = run_part("b", args, ["--pp", str(pp)], BUDGET - (time.perf_counter() - start))
        b.setdefault("label", f"tp 4 x pp {pp}")
        print("(b)", json.dumps(b), flush=True)
        bs.append(b)
    files = gpu_tests()
    if not files:
        tests = {"line": "No GPU-only tests in tests/ (no test file skips without CUDA)."}
    else:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", *map(str, files)], cwd=ROOT,
                              capture_output=True, text=True, timeout=max(30, BUDGET - (time.perf_counter() - start)))
        last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        tests = {"line": f"{len(files)} files ({', '.join(str(f.relative_to(ROOT)) for f in files)}): {last}"}
    print("(c)", tests["line"])
    slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"gpu_{slug}.md"
    out.write_text(markdown(device, a, bs, tests, time.perf_counter() - start))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
