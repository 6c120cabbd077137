"""Every plain file path written in a docstring or comment (of ``nnscaler/``, ``verify/``, ``opzoo/``,
``bench/``, ``tools/``, ``examples/``, ``tests/``) or in the Markdown documents (``README.md``,
``docs/*.md``, ``bench/README.md``) names a file or folder that exists.

A path is checked when its first folder exists: from the repository root (``verify/cases/model.py``),
or from the folder of the file that writes it or a folder above (``cases/model.py`` inside
``verify/``). Not checked: citations of other repositories (``pytorch/pytorch:torch/...``, or a first
folder this repository lacks: ``torch/distributed/...``, ``transformers/models/...``), placeholders
(``bench/<group>/<x>.py``, ``DIR/x.json``, ``*``), and what a run writes under ``reports/`` (its
contents vary from run to run)."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
CODE = ("nnscaler", "verify", "opzoo", "bench", "tools", "examples", "tests")
# a relative path of at least two parts, the last a file name with an extension or a folder ending in "/"
PATH = re.compile(r"(?<![\w./~$<{-])((?:\.?[A-Za-z_][\w.-]*/)+(?:[\w-]+(?:\.[A-Za-z]\w*)+\b|[\w-]*(?=[\s`'\"),;:]|$)))")
CITATION = re.compile(r"[\w.-]+/[\w.-]+:$")  # `owner/repo:` right before the path: another repository's file
GENERATED = ("reports/",)  # verify all's default output: what it holds varies by run


def _texts(path: Path):
    """``(line, text)`` of each docstring (any statement that is a lone string) and comment of a
    Python file, each line of a Markdown file."""
    source = path.read_text()
    if path.suffix == ".md":
        yield from enumerate(source.splitlines(), 1)
        return
    lone = {(n.lineno, n.col_offset) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in lone):
            for i, line in enumerate(tok.string.splitlines()):
                yield tok.start[0] + i, line


def _documents() -> list[Path]:
    files = [p for d in CODE if (ROOT / d).is_dir() for p in sorted((ROOT / d).rglob("*.py"))]
    files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
    return [p for p in files if p.exists() and "__pycache__" not in p.parts]


def _bases(path: Path) -> list[Path]:
    """Where a path written in ``path`` may start: the root, then the file's folder and each above it."""
    return [ROOT, *[d for d in path.parents if d != ROOT and ROOT in d.parents]]


def stale_paths() -> list[str]:
    """``file:line: path`` for every written path that names nothing."""
    out = []
    for doc in _documents():
        bases = _bases(doc)
        for lineno, text in _texts(doc):
            for m in PATH.finditer(text):
                written = m.group(1).rstrip(".")
                if CITATION.search(text[:m.start()]) or written.startswith(GENERATED) or written.startswith("./"):
                    continue
                first = written.split("/")[0]
                starts = [b for b in bases if (b / first).is_dir()]
                if starts and not any((b / written).exists() for b in starts):
                    out.append(f"{doc.relative_to(ROOT)}:{lineno}: {written}")
    return out


def test_every_path_written_in_a_docstring_comment_or_document_exists():
    stale = stale_paths()
    assert not stale, ("paths written in docstrings, comments or docs that name no file (file:line: path); "
                       "point each at where the file lives now:\n  " + "\n  ".join(stale))
