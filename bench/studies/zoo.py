"""How general the compiler is on ``transformers``' zoo: causal LM, masked LM, seq2seq LM, image and
audio classification architectures of the pinned version, each built from its config class's
defaults shrunk (``verify.models.zoo``, named ``zoo:<model_type>``), traced, planned by ``dp`` and
``tp`` (and ``autodist`` under a memory budget, statically) at W=2, and trained two AdamW steps under each on real ranks against one device by the
harness's model cases (``verify.rows.run.run_model``).

    python bench/studies/zoo.py [--sample 48 | --all] [--kinds causal image ...] [--archs albert vit ...] [--no-match]
                        [--resume] [--wide N] [--timeout S] [--md reports/zoo.md] [--json reports/zoo.json]

One row per architecture: kind, builds, traces (or the first line of the refusal), matches (dp and
tp against one device), dp forward collectives (1 = the loss alone; "+ N coupled": N batch-coupled
collectives inside operators, one per batch norm: SyncBatchNorm's statistics, inherent to a
program that equals one device, counted apart like a contrastive loss's), tp forward collectives per
layer and whether that meets Megatron's bar (at most 2 per layer plus 4 for embedding and loss),
the same under ``autodist``, attention split by heads under tp (share of the attention-score operators: softmax or
sdpa), share of the blocks' parameters stored split under tp, operators kept whole under dp with
why (no rule / indivisible / whole). The static figures come from ``bench/studies/zoo_sweep.py``'s worker
(a per-architecture alarm, a crashed worker restarted); each architecture's rank cases get the
harness's time limit (``--timeout`` x the model factor). The JSON is written after every
architecture: ``--resume`` keeps its finished rows, so a cut-off sweep goes on where it stopped.
``--wide N`` also trains N of the architectures that match, evenly over them, at W=4 under ``dp``,
``tp`` and ``random`` (seed 0); ``--bf16 N`` N of them at W=2 under ``dp`` and ``tp`` with
``precision="bf16-mixed"``, against the single-device run of the recipe. ``--sample N`` spreads N over the kinds by the square root of their share of the zoo (at least 4 each), evenly over
each kind's sorted model types (deterministic).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "bench" / "studies")) if p not in sys.path]

import zoo_sweep  # noqa: E402  (bench/studies/zoo_sweep.py: the worker, the alarm, the row's figures)

from verify.models.zoo import KINDS, archs_of, build, kind_of  # noqa: E402

WORLD, STEPS = 2, 2
WIDE, WIDE_POLICIES = 4, ("dp", "tp", "random")  # --wide N: a sample of N also at W=4, random plans included
BF16 = "bf16-mixed"  # --bf16 N: a sample of N also under this recipe
ATTENTION = ("softmax", "scaled_dot_product_attention")
AUTODIST_BUDGET = 0.6  # autodist's per-rank memory budget, a share of the one-device peak (see extra())


def sample(n: int, kinds=KINDS) -> list[str]:
    """``n`` model types over ``kinds``, each kind's share by the square root of its size (at least 4;
    causal LMs are most of the zoo), spread evenly over the kind's sorted types."""
    per = {k: archs_of(k) for k in kinds}
    total = sum(len(v) ** 0.5 for v in per.values())
    out = []
    for k, names in per.items():
        m = min(len(names), max(4, round(n * len(names) ** 0.5 / total)))
        out += names if m >= len(names) else [names[round(i * (len(names) - 1) / (m - 1))] for i in range(m)]
    return out


def attention_split(graph, plan) -> tuple[int, int]:
    """(attention-score operators, of them split on their heads) under ``plan``: softmax and sdpa
    outputs of 3 or more dims whose last dim (the keys) is over 1 (a softmax over a length-1 last
    dim weighs tokens, as additive attention does: no heads). Split by heads as
    :func:`nnscaler.policies.heads.heads_split` reads it: a dim between the batch and the (queries,
    keys) pair, dim 0 of 3-d scores in blocks (heads merged into the batch), or a dim before the keys
    that comes from a projection's features (Longformer's (batch, queries, heads, window))."""
    from nnscaler.policies.heads import heads_split
    n = split = 0
    for op in graph.ops:
        out = op.outputs[0] if op.outputs else None
        if out is None or len(out.shape) < 3 or not any(a in op.overload for a in ATTENTION) or out.shape[-1] == 1:
            continue
        n += 1
        split += bool(op.known and heads_split(op, plan))
    return n, split


def extra(graph, dp, tp, out: dict) -> None:
    """The sweep's figures beyond ``zoo_sweep.row``'s, ``autodist``'s plan at W=2 among them (its forward
    collectives and attention split, or the first line of why it planned nothing) under a memory budget
    of :data:`AUTODIST_BUDGET` of the one-device peak: unbounded, the cost model keeps a tiny model
    whole (replicated compute beats any collective at these widths), which says nothing of its search."""
    from nnscaler.compile.plan import plan_graph
    from nnscaler.config import ComputeConfig
    from nnscaler.policies.coverage import replicated_operators
    from nnscaler.policies.tp_check import collectives, layer_paths, layer_runs
    out["attn"], out["attn_split"] = attention_split(graph, tp)
    try:
        one = dp.summary()["memory_one_device"]["peak"]
        auto = plan_graph(graph, "autodist", ComputeConfig(WORLD, mem_budget=int(AUTODIST_BUDGET * one)))
        out["auto_fwd"] = sum(collectives(graph, auto, params=False)[0].values())
        out["auto_attn_split"] = attention_split(graph, auto)[1]
    except Exception as exc:  # noqa: BLE001  (a figure of the row, whatever breaks: the row still stands)
        if isinstance(exc, TimeoutError):
            raise
        out["auto_error"] = zoo_sweep.first_line(exc)
    out["layers"] = layer_runs(graph)  # a shared layer (ALBERT) counts once per run
    out["block_params"] = any(layer_paths([t.target or t.name for t in graph.params]).values())
    reasons = Counter(f"{r.op.overload.removeprefix('aten.')} ({r.reason})" for r in replicated_operators(graph, dp))
    out["whole_why"] = [f"{k} x{v}" if v > 1 else k for k, v in reasons.most_common()]


def static_row(arch: str, kv_heads: int) -> dict:
    def built(a, k):
        case = build(a, 0, k)
        return case.model, case.batch(0)
    r = zoo_sweep.row(arch, kv_heads, build=built, extra=extra)
    return {**r, "kind": kind_of(arch)}


def match(archs: list[str], rows: dict, timeout_s: float, save, world: int = WORLD,
          policies: tuple[str, ...] = ("dp", "tp"), key: str = "match", precision: str = "32-true") -> None:
    """Train each traced architecture under ``policies`` (seed 0) at W=``world`` on one gang, under
    the ``precision`` recipe; ``rows[arch][key]``: ``{policy: status or 'status: detail'}``; ``save()`` after each."""
    from verify.config import RunConfig
    from verify.runner.gang import Gang
    from verify.rows.run import run_model
    cfg = RunConfig(world_sizes=(world,), seeds=(0,), timeout_s=timeout_s, precision=precision)
    with tempfile.TemporaryDirectory() as tmp, Gang(world, (), (world,), pg_timeout_s=max(300.0, 2 * cfg.limit_s("model", STEPS))) as gang:
        for arch in archs:
            t0 = time.perf_counter()
            got = {}
            for row in run_model(gang, f"zoo:{arch}", policies, cfg, tmp, STEPS, checkpoint=False):
                got[row.partition] = row.status if row.ok else f"{row.status}: {(row.detail or '').splitlines()[0][:120] if row.detail else ''}"
            rows[arch][key] = got
            rows[arch][f"{key}_seconds"] = round(time.perf_counter() - t0, 1)
            print(f"  {arch} at W={world}: {got} ({rows[arch][f'{key}_seconds']} s)", flush=True)
            save()


def wide_sample(rows: dict, archs: list[str], n: int) -> list[str]:
    """``n`` of the architectures that trace and matched at W=2, evenly over their order (deterministic)."""
    ok = [a for a in archs if _ok(rows[a]) and matched(rows[a])]
    return ok[::max(1, len(ok) // n)][:n] if n else []


def _ok(r: dict) -> bool:
    return r.get("stage") == "ok"


def matched(r: dict) -> bool | None:
    m = r.get("match")
    return None if not m else all(v == "match" for v in m.values())


def tp_megatron(r: dict) -> bool:
    """Megatron's bar on tp's forward collectives: at most 2 per layer plus 4 (embedding and loss)."""
    return r["tp_fwd"] <= 2 * r["layers"] + 4


def summary(rows: dict) -> dict:
    built = [r for r in rows.values() if r["stage"] != "build"]
    ok = [r for r in rows.values() if _ok(r)]
    att = [r for r in ok if r["attn"]]
    blocks = [r for r in ok if r["block_params"]]
    ran = [r for r in ok if matched(r) is not None]
    return {"sampled": len(rows), "build": len(built), "trace": len(ok), "ran on ranks": len(ran),
            "match": sum(bool(matched(r)) for r in ran), "dp one collective": sum(r["dp_fwd"] <= 1 for r in ok),
            "attention models": len(att), "tp attention by heads": sum(r["attn_split"] == r["attn"] for r in att),
            "tp fwd <= 2/layer + 4": sum(tp_megatron(r) for r in att),
            "autodist planned": sum("auto_fwd" in r for r in ok),
            "with blocks": len(blocks), "tp block params split >= 1-1/W": sum(r["tp_split"] >= 1 - 1 / WORLD for r in blocks)}


def goals(s: dict) -> list[str]:
    """Each goal's figure and whether it is met, judged on the exact fraction (a 96.8% shown as 97% is not a
    goal of 97% met)."""
    def line(what, a, b, goal, tail=""):
        if not b:
            return f"{what}: -{tail}"
        met = a / b >= goal
        return (f"{what}: {a}/{b} = {100 * a / b:.1f}%{tail} (goal {'' if goal == 1 else '>= '}{100 * goal:g}%: "
                f"{'met' if met else 'NOT met'})")
    return [line("traces of those that build", s["trace"], s["build"], 0.98),
            line("match of those that trace and ran", s["match"], s["ran on ranks"], 1.0),
            line("dp one forward collective", s["dp one collective"], s["trace"], 0.98),
            line("tp attention split by heads", s["tp attention by heads"], s["attention models"], 0.97),
            line("tp forward collectives <= 2 per layer + 4", s["tp fwd <= 2/layer + 4"], s["attention models"], 0.90,
                 " of attention models"),
            line("tp block params split >= 1-1/W", s["tp block params split >= 1-1/W"], s["with blocks"], 0.95),
            f"autodist planned at W={WORLD} under {AUTODIST_BUDGET:g} x the one-device peak: "
            + (f"{s['autodist planned']}/{s['trace']} = {100 * s['autodist planned'] / s['trace']:.1f}%"
               if s["trace"] else "-")]


def _match_cell(r: dict) -> str:
    m = r.get("match")
    if not _ok(r):
        return "-"
    if not m:
        return "not run"
    return ", ".join(f"{p} {v}" for p, v in m.items()).replace("|", "/")


def table(rows: dict) -> str:
    lines = ["| arch | kind | params | traces | matches (W=2, 2 steps) | dp fwd coll. | tp fwd coll. / layer | "
             "tp <= 2/layer + 4 | tp attention by heads | tp block params split | autodist fwd coll. / layer "
             f"(attention by heads; budget {AUTODIST_BUDGET:g} x one device) | dp ops kept whole (why) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arch, r in rows.items():
        status = "yes" if _ok(r) else f"{r['stage']}: {r.get('error', '')}".replace("|", "/")
        if not _ok(r):
            lines.append(f"| {arch} | {r.get('kind', '-')} | {r.get('params', '-')} | {status} | - | - | - | - | - | - "
                         f"| - | - |")
            continue
        per = f"{r['tp_fwd'] / r['layers']:.1f}" if r["layers"] else f"{r['tp_fwd']} (no layers)"
        bar = ("yes" if tp_megatron(r) else "no") if r["attn"] else "-"
        auto = (f"{r['auto_fwd'] / r['layers']:.1f}" if r["layers"] else f"{r['auto_fwd']}") if "auto_fwd" in r \
            else r.get("auto_error", "not run").replace("|", "/")
        if "auto_fwd" in r and r["attn"]:
            auto += f" ({r['auto_attn_split']}/{r['attn']})"
        att = f"{r['attn_split']}/{r['attn']}" if r["attn"] else "no attention"
        split = f"{r['tp_split']:.2f}" if r["block_params"] else "-"
        whole = ", ".join(r["whole_why"][:6]) + (f", {len(r['whole_why']) - 6} more" if len(r["whole_why"]) > 6 else "")
        dp = f"{r['dp_fwd']} + {r['dp_coupled']} coupled" if r.get("dp_coupled") else f"{r['dp_fwd']}"
        lines.append(f"| {arch} | {r['kind']} | {r['params']} | yes | {_match_cell(r)} | {dp} | {per} | {bar} | {att} | "
                     f"{split} | {auto} | {whole or '-'} |")
    return "\n".join(lines)


def report(rows: dict, command: str, seconds: float) -> str:
    s = summary(rows)
    line = ", ".join(f"{v} {k}" for k, v in s.items())
    out = [f"# bench/studies/zoo.py: {len(rows)} architectures of transformers' zoo, tiny configs, W={WORLD}", "",
           f"    {command}", "", f"Summary: {line}", ""] + [f"- {g}" for g in goals(s)]
    wide = {a: r["wide"] for a, r in rows.items() if r.get("wide")}
    if wide:
        good = sum(all(v == "match" for v in w.values()) for w in wide.values())
        out += ["", f"At W={WIDE} under {', '.join(WIDE_POLICIES)} (seed 0; `--wide {len(wide)}`, evenly over the "
                f"architectures that match at W={WORLD}): {good}/{len(wide)} match under all three", ""]
        out += [f"- {a}: " + ", ".join(f"{p} {v}" for p, v in w.items()).replace("|", "/") for a, w in wide.items()]
    bf16 = {a: r[BF16] for a, r in rows.items() if r.get(BF16)}
    if bf16:
        good = sum(all(v.endswith("match") for v in w.values()) for w in bf16.values())
        out += ["", f"Under {BF16} at W={WORLD}, dp and tp (seed 0; `--bf16 {len(bf16)}`, evenly over the architectures "
                f"that match at W={WORLD}), against the single-device run of the recipe: {good}/{len(bf16)} match", ""]
        out += [f"- {a}: " + ", ".join(f"{p} {v}" for p, v in w.items()).replace("|", "/") for a, w in bf16.items()]
    out += ["", table(rows), "", "Operators kept whole under dp (architectures that have them):", ""]
    c = Counter(w.split(" x")[0] for r in rows.values() if _ok(r) for w in r["whole_why"])
    out += [f"- {op}: {n}" for op, n in c.most_common(20)]
    return "\n".join(out) + f"\n\n({seconds:.0f} s for this invocation)\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=48, help="how many model types, over the kinds")
    ap.add_argument("--all", action="store_true", help="every model type of --kinds (the full sweep)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--archs", nargs="+", help="these model types instead of a sample")
    ap.add_argument("--no-match", action="store_true", help="static figures only (no rank cases)")
    ap.add_argument("--resume", action="store_true", help="keep the finished rows of --json")
    ap.add_argument("--redo", nargs="+", default=[], help="with --resume: these architectures afresh")
    ap.add_argument("--wide", type=int, default=0, metavar="N",
                    help=f"also train N of the matching architectures at W={WIDE} under {', '.join(WIDE_POLICIES)}")
    ap.add_argument("--bf16", type=int, default=0, metavar="N",
                    help=f"also train N of the matching architectures at W={WORLD} under dp and tp with precision {BF16}")
    ap.add_argument("--timeout", type=float, default=30.0, help="the harness's case timeout (a model case gets 8x)")
    ap.add_argument("--md", default=str(ROOT / "reports" / "zoo.md"))
    ap.add_argument("--json", default=str(ROOT / "reports" / "zoo.json"))
    ap.add_argument("--kv-heads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return zoo_sweep.worker(args.worker, args.kv_heads, row=static_row)
    bad = [a for a in args.archs or () if kind_of(a) is None]
    if bad:
        sys.exit(f"bench/studies/zoo.py: error: {bad[0]!r} is no model type of the swept kinds ({', '.join(KINDS)})")
    archs = args.archs or ([a for k in args.kinds for a in archs_of(k)] if args.all else sample(args.sample, args.kinds))
    t0 = time.perf_counter()
    jpath = Path(args.json)
    rows: dict = json.loads(jpath.read_text()) if args.resume and jpath.is_file() else {}
    for a in args.redo:
        rows.pop(a, None)

    def save():
        jpath.parent.mkdir(parents=True, exist_ok=True)
        jpath.write_text(json.dumps(rows, indent=1))

    todo = [a for a in archs if a not in rows]
    if todo:
        print(f"static figures of {len(todo)} architectures", flush=True)
        rows.update(zoo_sweep.run_tree(ROOT, todo, args.kv_heads, Path(__file__).resolve()))
        save()
    if not args.no_match:
        run = [a for a in archs if _ok(rows[a]) and not rows[a].get("match")]
        print(f"rank cases of {len(run)} architectures", flush=True)
        match(run, rows, args.timeout, save)
        wide = [a for a in wide_sample(rows, archs, args.wide) if not rows[a].get("wide")]
        if wide:
            print(f"rank cases of {len(wide)} architectures at W={WIDE}", flush=True)
            match(wide, rows, args.timeout, save, WIDE, WIDE_POLICIES, "wide")
        bf16 = [a for a in wide_sample(rows, archs, args.bf16) if not rows[a].get(BF16)]
        if bf16:
            print(f"rank cases of {len(bf16)} architectures under {BF16}", flush=True)
            match(bf16, rows, args.timeout, save, precision=BF16, key=BF16)
    command = "python bench/studies/zoo.py " + " ".join(sys.argv[1:])
    text = report({a: rows[a] for a in archs}, command, time.perf_counter() - t0)
    Path(args.md).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
