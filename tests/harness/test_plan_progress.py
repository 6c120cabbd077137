"""``verify plan`` says what it does while it does it: a line before the plan is reduced, built and
checked, then the progress line of its run, as every other command shows (verify/report/progress.py)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import verify.plan.cli as plan_cli
import verify.runner.gang as gang_module
from verify.arguments import build_parser
from verify.judge.row import Row
from verify.judge.verdict import MATCH


class _Gang:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_plan_shows_progress_before_and_while_it_runs(monkeypatch, capsys, tmp_path):
    par = SimpleNamespace(tp=2, sequence_parallel=False, pp=1, virtual_stages=1, dp=1, micro_batch_size=1,
                          num_microbatches=1, zero=0, recompute="none", schedule="1F1B", cp=1, cp_scheme="allgather",
                          cp_balanced=True)
    arch = {"transformers": "LlamaForCausalLM", "config": {"num_hidden_layers": 2, "hidden_size": 64}}
    case = SimpleNamespace(saved=SimpleNamespace(path=Path("p.json"), parallel=par, world=2, precision="32-true"),
                           reduced=SimpleNamespace(world=2, parallel=par, architecture=arch), label="tp2 32-true",
                           config=SimpleNamespace(num_microbatches=1), policy="tp")
    said_first = []

    def prepare(*args, **kwargs):
        said_first.append(capsys.readouterr().out)  # what the user saw before the slow part
        return case

    row = Row("plan:p.json", "model", "3 AdamW steps vs one device", 2, "tp2", "float32", 0, MATCH)
    monkeypatch.setattr(plan_cli, "prepare", prepare)
    monkeypatch.setattr(plan_cli, "plan_rows", lambda *a, **k: [row])
    monkeypatch.setattr(gang_module, "Gang", _Gang)
    assert plan_cli.cmd_plan(build_parser().parse_args(["plan", str(tmp_path / "p.json")])) == 0
    assert said_first and said_first[0].startswith(f"reading {tmp_path / 'p.json'}: reducing it"), said_first
    out = capsys.readouterr().out
    assert "[1/1] plan:p.json tp2 32-true" in out and "1 match" in out, out
