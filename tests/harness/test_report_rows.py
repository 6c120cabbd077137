"""How rows read: a sampling failure is labelled as such everywhere (not ``W0[-]``), and rerun commands
carry every setting that decides a row, assembled in one place."""
from __future__ import annotations

import shlex
import xml.etree.ElementTree as ET

from verify.report import html as html_report
from verify.judge.verdict import ERROR
from verify.config import RunConfig
from verify.judge.row import Row
from verify.report.writer import junit, table
from verify.kinds.model import Model
from verify.kinds.op import Op


def _sampling_row() -> Row:
    return Row("my_op", "custom", "a -> a", 0, "sampling", "float32", 0, ERROR, detail="sampling failed: boom")


def test_a_sampling_failure_reads_as_sampling_everywhere():
    row = _sampling_row()
    assert row.case_label == "sampling"
    assert Row("my_op", "custom", "a -> a", 2, "a=2", "float32", 0, ERROR).case_label == "W=2 [a=2]"
    line = next(line for line in table([row]).splitlines() if "my_op" in line or "sampling failed" in line)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:2] == ["-", "sampling"], cells
    (case,) = ET.fromstring(junit([row]).split("?>", 1)[1]).iter("testcase")
    assert case.get("name").startswith("sampling") and "W0" not in case.get("name")
    page = html_report.render([row], {"config": {"world_sizes": [2], "dtype": "float32", "seeds": [0]},
                                      "summary": {"cases": 1, ERROR: 1}, "seconds": 0.0, "host": "h", "finished": "t"})
    assert "<td>-</td><td>sampling</td>" in page.replace("\n", ""), page[:3000]


def test_rerun_commands_carry_every_setting_of_the_row():
    cfg = RunConfig(world_sizes=(2, 4), dtype="float64", modules=("my ops.py",))
    op = shlex.split(Op.rerun_command(cfg, "bmm", 2, "m=2", 3))
    assert op[:5] == ["python", "-m", "verify", "op", "bmm"]
    flags = dict(zip(op[5::2], op[6::2]))
    assert flags == {"--world-size": "2", "--partition": "m=2", "--seed": "3", "--dtype": "float64", "--base": "4",
                     "--module": "my ops.py"}
    model = shlex.split(Model.rerun_command(cfg, "nanogpt", "tp", 4, 1, 5, bucket_bytes=256))
    flags = dict(zip(model[5::2], model[6::2]))
    assert flags == {"--policy": "tp", "--world-size": "4", "--seed": "1", "--steps": "5", "--dtype": "float64",
                     "--bucket-bytes": "256", "--module": "my ops.py"}
    assert "--bucket-bytes" not in Model.rerun_command(cfg, "nanogpt", "tp", 4, 1, 5)  # left out when not set


def test_every_rerun_goes_through_one_builder():
    cfg = RunConfig(world_sizes=(2,))
    calls = []
    original = RunConfig.command

    class Spy(RunConfig):
        def command(self, kind, name, flags):
            calls.append((kind, name))
            return original(self, kind, name, flags)

    spy = Spy(**{f: getattr(cfg, f) for f in ("world_sizes", "dtype", "seeds", "modules")})
    Op.rerun_command(spy, "relu", 2, "a=2", 0)
    Model.rerun_command(spy, "nanogpt", "dp", 2, 0, 3)
    assert calls == [("op", "relu"), ("model", "nanogpt")]


def test_all_with_op_trains_no_model_unless_asked(tmp_path, capsys):
    from verify.cli import main
    from verify.report.writer import load_rows
    assert main(["all", "--op", "relu", "--world-size", "2", "--reports", str(tmp_path)]) == 0
    rows = load_rows(tmp_path)
    assert rows and {r.op for r in rows} == {"relu"}, [r.op for r in rows]
    assert "model:" not in capsys.readouterr().out


def test_a_long_reason_wraps_in_the_terminal_table_and_stays_whole_in_report_md(tmp_path):
    """A failing row's reason (300-700 characters once localised) wraps after its clauses in the
    terminal's table; report.md and the JSON rows keep it on one line."""
    from verify.judge.verdict import MISMATCH
    from verify.report.writer import DETAIL_WIDTH, ReportWriter
    clauses = ["grad model.h.0.attn.c_attn.weight step 0 on rank 1: error 0.018 > tolerance 4e-07",
               "first divergent operator: linear_3 (aten.linear.default) at model.py:12 [h=2]",
               "every tensor before it matches the single-device run", "its inputs agree", "its output does not"]
    row = Row("model:x", "model", "3 AdamW steps vs one device", 2, "tp", "float32", 0, MISMATCH,
              detail="; ".join(clauses), rerun="python -m verify model x --policy tp --world-size 2")
    lines = table([row]).splitlines()
    assert len(lines) == 2 + 4 and all(c in "\n".join(lines) for c in clauses)  # no clause cut
    reason_width = max(len(c) for c in clauses) + 1
    assert max(map(len, lines)) < len(table([row], wrap=None).splitlines()[2]) - len(row.detail) + reason_width + 4
    assert len(table([row], wrap=None).splitlines()) == 3 and DETAIL_WIDTH <= 80
    writer = ReportWriter(str(tmp_path), RunConfig())
    writer.add(row)
    writer.close()
    assert row.detail in (tmp_path / "report.md").read_text()
