"""``python -m verify --help``, ``--version``, a bad flag and a cached ``list`` answer without
importing torch; the names the parser offers agree with the registries they mirror."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verify.catalogue import catalogue_key, source_dirs
from verify.names import DTYPE_NAMES, PIPELINE_NAMES, POLICY_NAMES, TORCHPAR_NAMES

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import sys\nfrom verify.__main__ import main\n"
         "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as exc:\n    rc = exc.code\n"
         "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\nsys.exit(rc)\n")


def probe(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m verify ARGS`` as the shell runs it, saying on its last stderr line whether torch was imported."""
    env = dict(os.environ, **({"XDG_CACHE_HOME": str(cache)} if cache else {}))
    return subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args, code, out", [
    (["--help"], 0, "usage: python -m verify"),
    (["--version"], 0, "python -m verify "),
    (["model", "--help"], 0, "--dtype"),
    (["all", "--help"], 0, "--resume"),
    (["op", "linear", "--timeout", "1e-9"], 2, ""),
    (["op", "linear", "--seed", "99999999999999999999999"], 2, ""),
])
def test_answers_without_torch(args, code, out):
    r = probe(*args)
    assert r.returncode == code and out in r.stdout, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == "no torch", r.stderr


def test_list_is_cached_by_the_source_it_lists(tmp_path):
    first, second = probe("list", cache=tmp_path), probe("list", cache=tmp_path)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stderr.strip() == "torch imported" and second.stderr.strip() == "no torch"
    assert first.stdout == second.stdout and "| linear " in first.stdout and first.stdout.rstrip().endswith("operators")


def test_a_source_edit_changes_the_catalogue_key(tmp_path):
    dirs = source_dirs()
    assert {ROOT / "nnscaler", ROOT / "opzoo"} <= set(dirs)
    (tmp_path / "ops.py").write_text("A = 1\n")
    before = catalogue_key([tmp_path])
    assert catalogue_key([tmp_path]) == before
    (tmp_path / "ops.py").write_text("A = 2\n")
    assert catalogue_key([tmp_path]) != before


def test_names_mirror_their_registries():
    from nnscaler.policies import POLICIES
    from nnscaler.policies.pipeline import PIPELINE_POLICIES
    from verify.cases.samples import DTYPES
    from verify.rows.torchpar_builtin import CASES
    assert POLICY_NAMES == tuple(n for n, fn in POLICIES.items() if fn.__module__.startswith("nnscaler."))  # not a test's own
    assert PIPELINE_NAMES == tuple(PIPELINE_POLICIES)
    assert DTYPE_NAMES == tuple(DTYPES)
    assert TORCHPAR_NAMES == tuple(sorted({c.name for c in CASES}))
