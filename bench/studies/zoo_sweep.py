"""How general the plans are on architectures the project never saw: a sample of the causal-LM types
of the pinned ``transformers``, each built from a generic tiny config (no download), traced on CPU
and planned by ``dp`` and ``tp`` at W=2 with ``plan_model``'s pieces (no ranks).

    python bench/studies/zoo_sweep.py [--sample 48] [--archs llama olmo2 ...] [--kv-heads 1] [--baseline DIR] [--out FILE.md]

Per architecture: builds? traces? (or the first line of why not), under ``dp`` the forward
collectives of a step (1 = the loss alone), the operators kept whole (``replicated_operators``: no
annotation, or annotated yet not split) and how many of those have no annotation; under ``tp`` the
share of the transformer blocks' parameters stored split. Below the table: the operators kept whole
most often under ``dp`` (by overload, counted once per architecture), the top reasons a plan is not
data parallel. ``--baseline DIR`` runs the same sample a second time on another source tree (e.g. an
``git archive`` of ``main``; it must have ``verify/models/zoo.py``), ``PYTHONPATH=DIR``, so the table
shows before -> after of the same run.

``--kv-heads K`` gives every config K key/value heads (default 2 of the 4 query heads; 1 is
multi-query attention, fewer kv heads than the W=2 ranks).

Each code tree runs in one worker process (a per-architecture alarm caps a slow one; a worker
that dies is restarted after the architecture that killed it, which becomes a failing row).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # verify.models.zoo when run as a script (PYTHONPATH's tree first)
    sys.path.append(str(ROOT))

from verify.models.zoo import TINY  # noqa: E402  (the tiny causal-LM config lives with the zoo's models)

BATCH, SEQ, WORLD = 4, 8, 2
TIMEOUT_S = 120


def sample(n: int) -> list[str]:
    """``n`` causal-LM model types spread evenly over the sorted catalogue (deterministic)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    types = sorted(names)
    if n >= len(types):
        return types
    return [types[round(i * (len(types) - 1) / (n - 1))] for i in range(n)] if n > 1 else types[:1]


def build(arch: str, kv_heads: int = TINY["num_key_value_heads"]):
    """The tiny model of ``arch`` returning its loss, and its sample arguments."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from verify.models.common import LossOf, causal_lm
    cfg = AutoConfig.for_model(arch, **{**TINY, "num_key_value_heads": kv_heads})
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    except (ValueError, ImportError):  # a model with no eager attention: its default
        model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(3, TINY["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return LossOf(causal_lm(model)).train(), (ids, ids.clone())


def row(arch: str, kv_heads: int, build=build, extra=None) -> dict:
    """One architecture's figures (see the module docstring); ``build(arch, kv_heads)`` gives its model
    and sample arguments, ``extra(graph, dp, tp, out)`` adds more figures to the row ``out``."""
    import torch
    from nnscaler.compile.plan import plan_graph, trace_model
    from nnscaler.config import ComputeConfig
    from nnscaler.policies.coverage import replicated_operators
    from nnscaler.policies.tp_check import collectives, coupled_collectives, sharded_fraction
    out: dict = {"arch": arch}
    try:
        model, args = build(arch, kv_heads)
    except Exception as exc:  # noqa: BLE001  (a row per architecture, whatever breaks)
        return {**out, "stage": _stage("build", exc), "error": first_line(exc)}
    out["params"] = sum(p.numel() for p in model.parameters())
    try:
        graph = trace_model(model, args, None, registry=None, strict=False)
    except Exception as exc:  # noqa: BLE001
        return {**out, "stage": _stage("trace", exc), "error": first_line(exc)}
    out["ops"] = len(graph.ops)
    try:
        dp = plan_graph(graph, "dp", ComputeConfig(WORLD))
        reps = replicated_operators(graph, dp)
        out["dp_fwd"] = sum(collectives(graph, dp, params=False)[0].values())
        out["dp_coupled"] = coupled_collectives(graph, dp)  # batch statistics (batch norm), one each
        out["dp_whole"] = len(reps)
        out["unknown"] = sum(r.reason == "unknown" for r in reps)
        out["dp_whole_ops"] = sorted({r.op.overload.removeprefix("aten.") + (" (no rule)" if r.reason == "unknown" else "")
                                      for r in reps})
        tp = plan_graph(graph, "tp", ComputeConfig(WORLD))
        out["tp_fwd"] = sum(collectives(graph, tp, params=False)[0].values())
        out["tp_split"] = round(sharded_fraction(graph, tp)[0], 3)
        if extra is not None:
            extra(graph, dp, tp, out)
    except Exception as exc:  # noqa: BLE001
        return {**out, "stage": _stage("plan", exc), "error": first_line(exc)}
    del torch
    return {**out, "stage": "ok"}


def _stage(stage: str, exc: BaseException) -> str:
    """``stage``, or ``timeout`` when the per-architecture alarm fired inside it (a tracer may wrap it)."""
    while exc is not None:
        if isinstance(exc, TimeoutError):
            return "timeout"
        exc = exc.__cause__ or exc.__context__
    return stage


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:140] if text else ''}"


def worker(archs: list[str], kv_heads: int, row=row) -> None:
    """Print one JSON line per architecture (a ``start`` line first, so a crash names its culprit);
    ``row(arch, kv_heads)`` computes it."""
    import signal
    import warnings
    warnings.simplefilter("ignore")
    import transformers
    transformers.logging.set_verbosity_error()

    def alarm(*_):
        raise TimeoutError(f"over {TIMEOUT_S} s")

    signal.signal(signal.SIGALRM, alarm)
    for arch in archs:
        print(json.dumps({"start": arch}), flush=True)
        t0 = time.perf_counter()
        signal.alarm(TIMEOUT_S)
        try:
            r = row(arch, kv_heads)
        except TimeoutError as exc:
            r = {"arch": arch, "stage": "timeout", "error": str(exc)}
        finally:
            signal.alarm(0)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(r), flush=True)


def run_tree(tree: Path, archs: list[str], kv_heads: int, script: Path = Path(__file__).resolve(),
             args: tuple[str, ...] = ()) -> dict[str, dict]:
    """Every architecture's row, computed by workers importing ``tree``'s code (``script --worker``
    with ``args``)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    rows: dict[str, dict] = {}
    todo = list(archs)
    while todo:
        proc = subprocess.run([sys.executable, str(script), *args, "--kv-heads", str(kv_heads), "--worker", *todo], env=env,
                              cwd=str(tree), capture_output=True, text=True)
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if "start" in r:
                started = r["start"]
            else:
                rows[r["arch"]] = r
                started = None
        if started is not None:  # the worker died inside this architecture
            tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            rows[started] = {"arch": started, "stage": "crash", "error": tail[:140]}
        todo = [a for a in todo if a not in rows]
        if started is None and todo:  # died between architectures: give up on the rest
            for a in todo:
                rows[a] = {"arch": a, "stage": "crash", "error": f"worker exit {proc.returncode}"}
            todo = []
    return rows


def _cell(r: dict | None, key: str) -> str:
    if r is None or r.get("stage") != "ok":
        return "-"
    v = r[key]
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _pair(before: dict | None, after: dict, key: str) -> str:
    a = _cell(after, key)
    if before is None:
        return a
    b = _cell(before, key)
    return a if a == b else f"{b} -> {a}"


def table(after: dict[str, dict], before: dict[str, dict] | None) -> str:
    lines = ["| arch | params | traces | dp fwd collectives | dp ops kept whole | of them no rule | tp block params split | tp fwd collectives |",
             "|---|---|---|---|---|---|---|---|"]
    for arch, r in after.items():
        b = before.get(arch) if before else None
        status = "yes" if r["stage"] == "ok" else f"{r['stage']}: {r['error']}".replace("|", "/")
        if b is not None and b["stage"] != r["stage"]:
            status = f"{b['stage']} -> {status}"
        lines.append(f"| {arch} | {r.get('params', '-')} | {status} | {_pair(b, r, 'dp_fwd')} | {_pair(b, r, 'dp_whole')} | "
                     f"{_pair(b, r, 'unknown')} | {_pair(b, r, 'tp_split')} | {_pair(b, r, 'tp_fwd')} |")
    return "\n".join(lines)


def summary(rows: dict[str, dict]) -> dict:
    ok = [r for r in rows.values() if r["stage"] == "ok"]
    built = [r for r in rows.values() if r["stage"] != "build"]
    return {"sampled": len(rows), "build": len(built), "trace_and_plan": len(ok),
            "dp_one_collective": sum(r["dp_fwd"] <= 1 for r in ok),
            "no_unknown_op": sum(r["unknown"] == 0 for r in ok),
            "tp_split_half": sum(r["tp_split"] >= 1 - 1 / WORLD for r in ok)}


def histogram(rows: dict[str, dict], top: int = 15, no_rule: bool = False) -> list[tuple[str, int]]:
    """Operators kept whole under ``dp`` (``no_rule``: only those without an annotation), counted
    once per architecture that has them."""
    c = Counter(op for r in rows.values() if r["stage"] == "ok" for op in r["dp_whole_ops"]
                if not no_rule or op.endswith(" (no rule)"))
    return c.most_common(top)


def report(after: dict[str, dict], before: dict[str, dict] | None, baseline: str | None, kv_heads: int) -> str:
    sa = summary(after)
    out = [f"# bench/studies/zoo_sweep.py: {sa['sampled']} causal-LM types of transformers, tiny configs, "
           f"{kv_heads} kv heads of 4, W={WORLD}", ""]
    head = "summary"
    if before is not None:
        sb = summary(before)
        out.append(f"Before (`{baseline}`) -> after (this tree), same run:")
        out.append("")
        out += [f"- {k.replace('_', ' ')}: {sb[k]} -> {sa[k]}" for k in sa]
        head = "after"
    else:
        out += [f"- {k.replace('_', ' ')}: {sa[k]}" for k in sa]
    out += ["", table(after, before)]
    for no_rule in (False, True):
        what = "Operators without a rule" if no_rule else "Operators kept whole"
        out += ["", f"{what} under dp ({head}; architectures that have them):", ""]
        now = histogram(after, 1000, no_rule)
        if before is not None:
            hb = dict(histogram(before, 1000, no_rule))
            out += [f"- {op}: {hb.get(op, 0)} -> {n}" for op, n in now[:15]]
            gone = [op for op in hb if op not in dict(now)]
            if gone:
                out += ["", "No longer kept whole anywhere: " + ", ".join(gone)]
        else:
            out += [f"- {op}: {n}" for op, n in now[:15]]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=48, help="how many model types, spread over the catalogue")
    ap.add_argument("--archs", nargs="+", help="these model types instead of a sample")
    ap.add_argument("--baseline", help="another source tree (e.g. main) to run the same sample on, for before/after")
    ap.add_argument("--out", help="also write the Markdown report here")
    ap.add_argument("--kv-heads", type=int, default=TINY["num_key_value_heads"],
                    help="key/value heads of every config (of 4 query heads; 1: multi-query attention)")
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.kv_heads)
    archs = args.archs or sample(args.sample)
    t0 = time.perf_counter()
    before = run_tree(Path(args.baseline).resolve(), archs, args.kv_heads) if args.baseline else None
    after = run_tree(ROOT, archs, args.kv_heads)
    text = report(after, before, args.baseline, args.kv_heads) + f"\n({time.perf_counter() - t0:.0f} s)\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
