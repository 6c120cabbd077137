"""``python -m verify merge DIR... [--reports OUT]``: the reports of the N shards of one ``verify all
--shard i/N`` sweep combined into one (``cases.jsonl``, JSON, Markdown, JUnit, HTML), after checking
that they are the N shares of one selection run by the same source, each once, and that no unit or case
is missing or twice (every row of every shard is kept, or the merge is refused)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from nnscaler.io import atomic_write

from verify.judge.row import Row
from verify.report.writer import CASES_FILE, ReportError, foreign_files, summary, write_reports
from verify.sweep.shard import ShardError, check_shards


def _load(directory: Path) -> tuple[dict, list[Row]]:
    path = directory / "report.json"
    try:
        meta = json.loads(path.read_text())
        rows = [Row(**r) for r in meta.pop("cases")]
    except FileNotFoundError:
        raise ShardError(f"{directory}: no report.json (not a verify all --reports directory)") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ShardError(f"{path}: unreadable ({type(exc).__name__}); run that shard again") from None
    if not meta.get("sweep"):
        raise ShardError(f"{directory}: not written by verify all (no sweep in report.json)")
    return meta, rows


def merge(directories: Sequence[str], out: str) -> tuple[int, list[Row]]:
    """Write the merged reports into ``out``; returns (shards, the merged rows). Raises :class:`ShardError`
    (shards that do not fit) or :class:`ReportError` (``out`` holds files verify did not write)."""
    loaded = [_load(Path(d)) for d in directories]
    metas = [m for m, _ in loaded]
    check_shards([m["sweep"] for m in metas])
    sources = {m["sweep"].get("source") for m in metas}
    if len(sources) != 1:
        raise ShardError("the shards ran other code or versions (their sources differ); merge shards of one run")
    configs = {json.dumps(m.get("config"), sort_keys=True) for m in metas}
    if len(configs) != 1:
        raise ShardError("the shards ran with other settings (world sizes, dtype, seeds or modules); merge shards "
                         "of one command")
    loaded.sort(key=lambda mr: mr[0]["sweep"]["shard"])
    rows = [r for _, rs in loaded for r in rs]
    seen: dict = {}
    for r in rows:
        if r.key in seen:
            raise ShardError(f"case {r.op} W={r.world_size} {r.partition} seed {r.seed} is in two shards")
        seen[r.key] = r
    first = loaded[0][0]
    sweep = dict(first["sweep"], shard=1, shards=1, merged=len(loaded),
                 units=[u for m, _ in loaded for u in m["sweep"]["units"]],
                 seconds={k: v for m, _ in loaded for k, v in m["sweep"].get("seconds", {}).items()})
    meta = {"config": first["config"], "summary": summary(rows), "seconds": max(m.get("seconds", 0.0) for m in metas),
            "host": ", ".join(sorted({m.get("host", "?") for m in metas})), "finished": first.get("finished"),
            "sweep": sweep}
    target = Path(out)
    foreign = foreign_files(target) if target.is_dir() else []
    if foreign:
        raise ReportError(f"{target} holds {', '.join(foreign)} that verify did not write; move "
                          f"{'it' if len(foreign) == 1 else 'them'} away or pass another --reports")
    try:
        target.mkdir(parents=True, exist_ok=True)
        atomic_write(target / CASES_FILE, "".join(json.dumps(r.to_json()) + "\n" for r in rows))
    except OSError as exc:
        raise ReportError(f"cannot write the merged reports into {target}: {exc.strerror or exc}") from None
    write_reports(target, rows, meta)
    return len(loaded), rows
