"""The verdict cache: a unit's rows kept under a key made of everything that can change them, so a
rerun after an edit reruns only the units the edit can affect (``verify all``; ``--no-cache`` ignores it).

The key of a unit (:meth:`VerdictCache.key`) holds its kind's entries (``cache_key``, ``verify/kinds/``: the
unit's operator, model or saved plan, policy, world sizes, seeds, micro-batches, replicas, recipe, resume;
a saved plan's file content), the run's settings (dtype, every field of the training recipe, base,
``--module`` files' contents), the torch and Python versions and the *core*: every source file of
``nnscaler/``, ``verify/`` and ``opzoo/`` except the catalogue's *leaf* files, the modules of the
family folders that register operators or rules (``opzoo/<family>/entries.py``, ``rules.py``,
``examples.py``, ``opzoo/moe/experts.py``; not the shared ``opzoo/rulekit.py`` and ``opzoo/kernels.py``).
A leaf is a dependency of just the units that can run what it registers: an operator unit depends
on its family's ``entries.py`` (a rule's example, ``rule.<name>.<k>``, on the modules with rules for
that operator and the families' ``examples.py``); a
torch-parallelization unit on none (torch's own modules run, no catalogue entry); a model unit on the
leaves that claim (register a spec or a rule for) an aten operator of its traced graphs, as its
ranks report them, and on the leaves those import. The entry keeps the graphs' operators, and the
claims are taken again at lookup: a leaf that claims one of them now (an edit added a rule) and is
not among the entry's dependencies makes it stale, as does any dependency whose file changed.

Only units whose rows all matched are kept: a failure (and a timeout, which may be the machine's)
always runs again. No library caches by content across processes and source edits this way (pytest's
cache keys by test id only), hence this module.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Sequence

from nnscaler.io import atomic_write

from verify.config import RunConfig

from verify.judge.row import Row
from verify.kinds import kind_class
from verify.sweep.selection import Unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("nnscaler", "verify", "opzoo")
FORMAT = 4  # bump when the entry layout or the dependency rule changes


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_hash(path: Path) -> str:
    try:
        return _digest(path.read_bytes())
    except OSError:
        return "missing"


def leaves(root: Path = ROOT) -> list[Path]:
    """The catalogue's modules that register operators or rules: the modules of its family folders
    ``opzoo/<family>/`` (not their ``__init__``, nor the shared modules at the top of ``opzoo/``)."""
    return sorted(p for p in (root / "opzoo").glob("*/*.py") if not p.name.startswith("_"))


def entries_file(family: str, root: Path = ROOT) -> Path:
    """The file of a family's fixed-annotation entries: ``root/opzoo/<family>/entries.py``."""
    return root / "opzoo" / family / "entries.py"


def _module_file(obj, root: Path) -> Path:
    """``root/opzoo/nn/rules.py`` for a function of module ``opzoo.nn.rules`` (a partial: its function's)."""
    fn = getattr(obj, "func", obj)
    return root.joinpath(*(getattr(fn, "__module__", "") or "?").split(".")).with_suffix(".py")


def claims(registry, root: Path = ROOT) -> tuple[dict[Path, set[str]], dict[Path, set[str]]]:
    """``({leaf: overloads it has rules for}, {leaf: overloads its fixed entries claim})`` as the
    registry holds them now: a rule by the module that defines it, an entry's ``aten`` by its family's
    file. Rules are asked first (``nnscaler.trace.match.derive``): an operator a rule annotated
    depends on the rules for it, one no rule annotated on those and on the entries claiming it."""
    rules: dict[Path, set[str]] = {}
    fixed: dict[Path, set[str]] = {}
    for spec in registry:
        fixed.setdefault(entries_file(spec.family, root), set()).update(spec.aten)
    for overload in registry.rule_overloads():
        for rule in registry.rules(overload):
            rules.setdefault(_module_file(rule, root), set()).add(overload)
    return rules, fixed


def _imports(path: Path, known: dict[str, Path], root: Path) -> set[Path]:
    """The leaves module ``path`` imports (``from ..x import``, ``from opzoo.x.rules import``, ...)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return set()
    pkg = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {known[n] for n in names if n in known}


class Used:
    """What a unit's ranks ran: the aten operators of their graphs and those no rule annotated (the
    answers' ``used``, :func:`verify.cases.traces.graph_ops`); ``every`` when an answer says nothing
    (every leaf counts then)."""

    def __init__(self):
        self.ops: set[str] = set()
        self.fixed: set[str] = set()
        self.every = False

    def add(self, answers) -> None:
        for a in answers:
            got = (a.result or {}).get("used")
            if got is None:
                self.every = True
            else:
                self.ops.update(got["ops"])
                self.fixed.update(got["fixed"])


class VerdictCache:
    """``get(unit)`` -> the unit's rows (marked ``cached``) or None; ``put(unit, rows, ...)`` after a run."""

    def __init__(self, directory: str | os.PathLike, cfg: RunConfig, registry, root: Path = ROOT):
        """``root``: the source tree whose files key the verdicts (this checkout's)."""
        self.dir = Path(directory) / "verdicts"
        self.cfg = cfg
        self.registry = registry
        self.root = root
        self.leaves = leaves(root)
        known = {".".join(p.relative_to(root).with_suffix("").parts): p for p in self.leaves}
        self.imports = {p: _imports(p, known, root) for p in self.leaves}
        self.rules, self.fixed = claims(registry, root)
        core = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py") if p not in set(self.leaves))
        h = hashlib.sha256()
        for p in core:
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
        import torch  # noqa: PLC0415 (the version is part of every key)
        self.context = {"format": FORMAT, "core": h.hexdigest(), "torch": torch.__version__,
                        "python": platform.python_version(), "dtype": cfg.dtype,
                        "recipe": asdict(cfg.recipe),  # every field: a new recipe option keys the verdicts too
                        "base": cfg.base_override,
                        "partition": cfg.partition, "modules": [file_hash(Path(m)) for m in cfg.modules],
                        "layout": [list(kv) for kv in cfg.layout], "node": cfg.node}
        self.hits = self.misses = 0
        self._hashes: dict[Path, str] = {}  # each file read once per run

    def _hash(self, path: Path) -> str:
        if path not in self._hashes:
            self._hashes[path] = file_hash(path)
        return self._hashes[path]

    def key(self, unit: Unit) -> str:
        """The run's context and the unit's entries as its kind gives them (``cache_key``, ``verify/kinds/``:
        the unit's every field and, for a saved plan, its file's content)."""
        return _digest(json.dumps({**kind_class(unit.kind).cache_key(unit, self.root), **self.context},
                                  sort_keys=True, default=str).encode())

    def _path(self, unit: Unit) -> Path:
        k = self.key(unit)
        return self.dir / k[:2] / f"{k}.json"

    def _closure(self, paths: Iterable[Path]) -> set[Path]:
        out, todo = set(), list(paths)
        while todo:
            p = todo.pop()
            if p not in out:
                out.add(p)
                todo.extend(self.imports.get(p, ()))
        return out

    def depends(self, unit: Unit, ops: Iterable[str] = (), fixed: Iterable[str] = (), every: bool = False) -> set[Path]:
        """The leaves ``unit`` depends on: an operator unit, its family's entries; a model unit, the
        modules with rules for its graphs' ``ops`` and the files whose entries claim its ``fixed``
        ones (with what those import); every leaf with ``every``."""
        if every:
            return set(self.leaves)
        if unit.kind == "op":
            spec = self.registry.get(unit.name)
            own = entries_file(spec.family, self.root)
            if own in set(self.leaves):
                return self._closure([own])
            overloads = [o for o in self.registry.rule_overloads()  # a rule's example: rule.<short name>.<k>
                         if unit.name.rsplit(".", 1)[0] == "rule." + o.removeprefix("aten.").removesuffix(".default")]
            if not overloads:
                return set(self.leaves)
            examples = [p for p in self.leaves if p.name == "examples.py"]  # where the examples are written
            return {p for p in self._closure([p for p, c in self.rules.items() if c & set(overloads)] + examples)
                    if p in set(self.leaves)}
        ops, fixed = set(ops), set(fixed)
        found = [p for p, c in self.rules.items() if c & ops] + [p for p, c in self.fixed.items() if c & fixed]
        return {p for p in self._closure(found) if p in set(self.leaves)}

    def get(self, unit: Unit) -> list[Row] | None:
        try:
            entry = json.loads(self._path(unit).read_text())
            rows = [Row(**r) for r in entry["rows"]]
            deps: dict = entry["deps"]
        except (OSError, ValueError, TypeError, KeyError):
            self.misses += 1
            return None
        now = {str(p.relative_to(self.root)) for p in self.depends(unit, entry.get("ops", ()), entry.get("fixed", ()),
                                                                  entry.get("every", False))}
        fresh = rows and now <= set(deps) and all(self._hash(self.root / f) == h for f, h in deps.items())
        if not fresh:
            self.misses += 1
            return None
        self.hits += 1
        return [Row(**{**asdict(r), "cached": True}) for r in rows]

    def put(self, unit: Unit, rows: Sequence[Row], used: Used) -> None:
        """Keep ``rows`` of ``unit`` when every one matched, with the leaves it depends on."""
        if not rows or not all(r.ok for r in rows):
            return
        deps = {str(p.relative_to(self.root)): self._hash(p)
                for p in sorted(self.depends(unit, used.ops, used.fixed, used.every))}
        entry = {"unit": unit.label, "rows": [asdict(r) for r in rows], "deps": deps, "ops": sorted(used.ops),
                 "fixed": sorted(used.fixed), "every": used.every, "seconds": sum(r.seconds for r in rows)}
        path = self._path(unit)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(entry))
        except OSError:
            pass  # a cache that cannot be written costs time, never a verdict
