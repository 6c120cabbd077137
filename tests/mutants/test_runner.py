"""The mutation runner runs ``python -m verify all`` itself (the default sample, or ``--full``), with
the verdict cache off, so a mutant it kills is killed by the README's command; its results table
names the row that killed each one."""
from __future__ import annotations

import json
from pathlib import Path

from tests.mutants.run import command, first_failure, parser, write_results
from verify.cli import build_parser


def test_the_runner_runs_the_readme_command_without_the_cache(tmp_path):
    default = command("m", parser().parse_args([]), tmp_path)
    assert default[1:4] == ["-m", "verify", "all"] and "--no-cache" in default and "--full" not in default
    assert "--op" not in default and "--model" not in default  # every operator and model, as verify all
    assert default[-2] == "--module" and Path(default[-1]).read_text().count("mod.apply('m')") == 1
    full = command(None, parser().parse_args(["--sweep", "full"]), tmp_path)
    assert "--full" in full and "--module" not in full
    args = build_parser().parse_args(default[3:])
    assert args.no_cache and not args.full and args.op is None and args.model is None


def test_the_first_failing_row_is_named_in_the_results_table(tmp_path):
    rows = [{"op": "relu", "world_size": 2, "partition": "*0=2", "seed": 0, "status": "match", "detail": ""},
            {"op": "model:nanogpt", "world_size": 4, "partition": "tp", "seed": 0, "status": "MISMATCH",
             "detail": "grad a|b step 0 on rank 1: error 0.5 > tolerance 1e-6"}]
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    killer = first_failure(tmp_path)
    assert killer.startswith("model:nanogpt W=4 tp seed 0: MISMATCH, grad a|b step 0")
    assert first_failure(tmp_path / "none") == ""
    out = tmp_path / "RESULTS.md"
    write_results(str(out), {"a": ("killed", 12.3, killer), "b": ("survived", 99.0, "tail")}, ["--model", "nanogpt"])
    text = out.read_text()
    assert "| a | killed | model:nanogpt W=4 tp seed 0: MISMATCH, grad a/b" in text
    assert "| b | survived |  | 99 |" in text and "Kill rate: 1/2 = 50%." in text


def test_a_mutated_rule_reaches_the_operator_cases_derived_at_import():
    """The catalogue's examples are derived when opzoo is imported, before the runner's shim applies a mutant:
    applying one derives them again, so an operator case runs the mutated rule (here a strided slice read as
    blocks, which only a model reached before). In a child process: the mutant stays applied there."""
    import subprocess
    import sys
    code = ("from opzoo.rulekit import EXAMPLES\n"
            "from nnscaler.ops import DEFAULT_REGISTRY\n"
            "names = [n for n in EXAMPLES['aten.slice.Tensor'] if '2)' in DEFAULT_REGISTRY.get(n).annotation]\n"
            "from tests.mutants.catalog import apply\n"
            "apply('strided_slice_read_as_blocks')\n"
            "print(sorted(DEFAULT_REGISTRY.get(n).annotation for n in names))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    annotations = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307  (our own child's printed list)
    assert annotations and all("(2 " in a for a in annotations), annotations
