"""The house's import rules, read from the source (every import, at module level or inside a function):
the compiler (``nnscaler/``) never imports the harness (``verify/``) or the catalogue (``opzoo/``); no
import circle anywhere in the three packages; no private name imported across modules; the process
runner (``verify/runner/``) knows no case kind: it reaches the cases only through the kind registry
(``verify/kinds/``)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nnscaler", "verify", "opzoo")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, str | None]]:
    """``(imported module, name taken from it or None)`` for every import in ``module``, in-project only."""
    path = MODULES[module]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if target.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub, None) if sub in MODULES else (target, a.name))
    return out


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _ in imports(m):
            while target and target not in MODULES:  # an attribute path: the longest module prefix
                target = target.rpartition(".")[0]
            if target and target != m:
                edges[m].add(target)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_compiler_never_imports_the_harness_or_the_catalogue():
    bad = [(m, t) for m in MODULES if m.startswith("nnscaler")
           for t, _ in imports(m) if t.split(".")[0] in ("verify", "opzoo")]
    assert not bad, f"compiler -> harness/catalogue imports (inject instead): {bad}"


def test_no_import_circle():
    found = circles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_private_name_crosses_a_module_line():
    bad = [(m, t, n) for m in MODULES for t, n in imports(m)
           if n is not None and n.startswith("_") and not n.startswith("__")]
    assert not bad, f"private names imported across modules (make them public where they land): {bad}"


CASE_ROOMS = ("verify.cases", "verify.localize", "verify.rows")  # what a case kind runs, localises, judges into rows


def test_the_runner_reaches_the_cases_only_through_the_registry():
    bad = [(m, t) for m in MODULES if m.startswith("verify.runner")
           for t, _ in imports(m) if t.startswith(CASE_ROOMS) or (t.startswith("verify.kinds.") and t != "verify.kinds.registry")]
    assert not bad, f"runner -> case modules (ask the registry, verify.kinds): {bad}"


@pytest.mark.parametrize("kind", ["circle", "compiler->harness", "private", "runner->case"])
def test_the_checks_catch_what_they_guard(kind, tmp_path):
    """Each rule fails on a house that breaks it (the checks are not vacuous)."""
    files = {"circle": {"nnscaler/a.py": "from . import b\n", "nnscaler/b.py": "def f():\n    from .a import x\n"},
             "compiler->harness": {"nnscaler/a.py": "def f():\n    from verify.plan.check import verify_plan\n"},
             "private": {"verify/a.py": "from verify.b import _hidden\n", "verify/b.py": "_hidden = 1\n"},
             "runner->case": {"verify/runner/worker.py": "from verify.cases.model import run_model_job\n"}}[kind]
    fake = {}
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        fake[rel[:-3].replace("/", ".")] = p
    globals()["MODULES"], saved = fake, MODULES
    try:
        check = {"circle": test_no_import_circle, "compiler->harness": test_the_compiler_never_imports_the_harness_or_the_catalogue,
                 "private": test_no_private_name_crosses_a_module_line,
                 "runner->case": test_the_runner_reaches_the_cases_only_through_the_registry}[kind]
        with pytest.raises(AssertionError):
            check()
    finally:
        globals()["MODULES"] = saved
