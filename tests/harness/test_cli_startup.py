"""``python -m verify --help``, ``--version``, a bad flag, an argument error the parser can see (an
unknown policy, model or cached operator, a bad recipe value or ``--shard``) and a cached ``list``
answer without importing torch; the names the parser offers agree with the registries they mirror."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verify.catalogue import catalogue_key, source_dirs
from verify.names import DTYPE_NAMES, MODEL_NAMES, PIPELINE_NAMES, POLICY_NAMES, TORCHPAR_NAMES, WIDENABLE_NAMES

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


@pytest.mark.parametrize("args, line", [
    (["model", "nanogpt", "--policy", "nosuch"], "unknown policy 'nosuch'; built-in: autodist, cp, cp_balanced, cp_ring, cp_ring_balanced"),
    (["model", "nanogpt", "--policy", "tp", "nofile.py:plan"], "policy 'nofile.py:plan': nofile.py is not a Python file"),
    (["model", "nosuchmodel"], "unknown model 'nosuchmodel'; known: bert,"),
    (["model", "nanogpt@x"], "unknown model 'nanogpt@x'"),
    (["model", "nanogpt", "--zero", "5"], "--zero 5: zero must be 0, 1, 2 or 3"),
    (["model", "nanogpt", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["model", "nanogpt", "--precision", "bf16-mixed", "--dtype", "float64"], "--precision bf16-mixed sets the dtypes itself"),
    (["all", "--shard", "3/2"], "--shard '3/2': give i/N with 1 <= i <= N"),
    (["all", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["all", "--torchpar", "nosuch"], "--torchpar nosuch: no such case"),
    (["op", "--model", "nosuch", "--node", "linear_1"], "unknown model 'nosuch'"),
])
def test_argument_errors_answer_before_torch(args, line):
    """An argument error the parser can see is one line, exit 2, without torch (the gang, the model
    build and the compiler's import took 7-40 s before it)."""
    r = probe(*args)
    assert r.returncode == 2 and r.stderr.startswith(f"verify: error: {line}"), r.stderr
    assert r.stderr.strip().splitlines()[-1] == "no torch", r.stderr


def test_an_unknown_operator_answers_before_torch_once_the_catalogue_is_cached(tmp_path):
    assert probe("list", cache=tmp_path).returncode == 0  # caches the catalogue of this very source
    for args in (["op", "nosuchop"], ["all", "--op", "linr"], ["lint", "linr"]):
        r = probe(*args, cache=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith("verify: error: unknown operator "), r.stderr
        assert r.stderr.strip().splitlines()[-1] == "no torch", r.stderr
    assert "did you mean linear" in r.stderr, r.stderr


def test_what_only_the_registry_can_tell_is_left_to_it():
    """A ``--module`` file may register the model, operator or policy named: nothing is refused early."""
    from verify.argcheck import check_args, known_model_name
    from verify.arguments import build_parser
    assert known_model_name("tests/x.py:build") is None and known_model_name("zoo:gpt2") is None
    assert known_model_name("nanogpt@64") and not known_model_name("gpt2@64")  # gpt2 is not widenable
    for argv in (["op", "mine", "--module", "ops.py"], ["model", "mine", "--module", "m.py", "--policy", "mine"],
                 ["all", "--op", "mine", "--model", "mine", "--module", "m.py"]):
        check_args(build_parser().parse_args(argv))


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
    import verify.models  # noqa: F401  (the built-in catalogue registers itself)
    from verify.models.registry import MODELS, WIDENABLE

    def builtin(reg) -> tuple:  # the catalogue's own (the tests also register Megatron's tp_* models and their own)
        return tuple(sorted(n for n, b in reg.items() if b.__module__.startswith("verify.models.")
                            and b.__module__ != "verify.models.megatron"))
    if importlib.util.find_spec("transformers") is not None:
        assert (MODEL_NAMES, WIDENABLE_NAMES) == (builtin(MODELS), builtin(WIDENABLE))
    assert set(builtin(MODELS)) <= set(MODEL_NAMES)
