"""``verify list`` without torch: the catalogue's rows, cached under a key of everything that can
change them (the source of the compiler and of every operator catalogue it loads, the torch and
Python versions). A stale key is never read: the catalogue is imported again and the cache rewritten."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path
from typing import Iterable, Sequence

CATALOGUE_GROUP = "nnscaler.ops"  # the entry points the op registry loads its catalogues from
HEADERS = ("op", "family", "annotation", "aten")


def cache_file() -> Path:
    """Where the rows are kept: the user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nnscaler-verify" / "catalogue.json"


def source_dirs() -> list[Path] | None:
    """The package folders whose source decides the catalogue: ``nnscaler``, ``opzoo`` and each
    package an ``nnscaler.ops`` entry point names; None when one cannot be found without importing it."""
    roots = {"nnscaler", "opzoo"} | {ep.value.split(":")[0].split(".")[0] for ep in entry_points(group=CATALOGUE_GROUP)}
    out = []
    for root in sorted(roots):
        spec = importlib.util.find_spec(root)  # a top-level name: found, not imported
        if spec is None or not spec.submodule_search_locations:
            return None
        out += [Path(p) for p in spec.submodule_search_locations]
    return out


def catalogue_key(dirs: Iterable[Path]) -> str:
    """A digest of every ``.py`` file under ``dirs`` (names and bytes), the catalogue entry points,
    the torch and Python versions."""
    h = hashlib.sha256(sys.version.encode())
    try:
        h.update(version("torch").encode())
    except PackageNotFoundError:
        pass
    for ep in sorted(entry_points(group=CATALOGUE_GROUP), key=lambda e: e.name):
        h.update(f"{ep.name}={ep.value}\n".encode())
    for d in dirs:
        for path in sorted(Path(d).rglob("*.py")):
            h.update(str(path.relative_to(d)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def current_key() -> str | None:
    dirs = source_dirs()
    return None if dirs is None else catalogue_key(dirs)


def source_key() -> str | None:
    """A digest of the code a run ran (:func:`current_key`'s sources and ``verify/`` itself): ``verify
    merge`` merges only shards that share it; ``None`` where a package cannot be found."""
    dirs = source_dirs()
    return None if dirs is None else catalogue_key([*dirs, Path(__file__).parent])


def cached_rows(key: str | None) -> list[list[str]] | None:
    """The rows stored under ``key``, or None (no cache, another key, unreadable)."""
    if key is None:
        return None
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return None
    return data.get("rows") if isinstance(data, dict) and data.get("key") == key else None


def store_rows(key: str | None, rows: Sequence[Sequence[str]]) -> None:
    """Keep ``rows`` under ``key`` (atomically); a cache that cannot be written is left unwritten."""
    if key is None:
        return
    path = cache_file()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "rows": [list(r) for r in rows]}))
        os.replace(tmp, path)
    except OSError:  # only a cache: the next ``list`` imports the catalogue again
        tmp.unlink(missing_ok=True)


def render(rows: Sequence[Sequence[str]]) -> str:
    from tabulate import tabulate
    return tabulate(rows, headers=HEADERS, tablefmt="github") + f"\n\n{len(rows)} operators"
