"""``verify merge``: it exits as ``verify all`` would on the merged rows (1 when any failed), keeps
every row of every shard or refuses (a case in two shards, a missing shard, a shard of another
selection or of other code), and never overwrites files verify did not write."""
from __future__ import annotations

import json

import pytest

from verify.config import RunConfig
from verify.judge.row import Row
from verify.cli import main
from verify.judge.verdict import MATCH, MISMATCH
from verify.report.writer import ReportWriter

CFG = RunConfig(world_sizes=(2,))


def _row(op: str, status: str = MATCH) -> Row:
    return Row(op, "activation", "a -> a", 2, "a=2", "float32", 0, status)


def _shard(directory, i: int, n: int, rows, units, source: str = "s1", total: int = 2) -> str:
    w = ReportWriter(directory, CFG)
    w.sweep = {"mode": "default", "selection": "x", "source": source, "shard": i, "shards": n, "total": total,
               "units": list(units), "rerun": [], "seconds": {}}
    for r in rows:
        w.add(r)
    w.close()
    return str(directory)


def test_merge_exits_1_when_a_merged_row_failed_and_0_when_all_matched(tmp_path, capsys):
    a = _shard(tmp_path / "a", 1, 2, [_row("relu")], ["relu"])
    b = _shard(tmp_path / "b", 2, 2, [_row("gelu", MISMATCH)], ["gelu"])
    assert main(["merge", a, b, "--reports", str(tmp_path / "m")]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "gelu" in out and out.strip().splitlines()[-1].startswith("merged 2 shards, 2 cases")
    assert json.loads((tmp_path / "m" / "report.json").read_text())["summary"] == {"cases": 2, "match": 1, "MISMATCH": 1}
    ok = _shard(tmp_path / "ok", 2, 2, [_row("gelu")], ["gelu"])
    assert main(["merge", a, ok, "--reports", str(tmp_path / "m2")]) == 0


def test_a_case_in_two_shards_is_refused_never_one_of_its_rows_kept(tmp_path, capsys):
    """A rerun's MISMATCH must not vanish behind the other shard's match of the same case."""
    a = _shard(tmp_path / "a", 1, 2, [_row("relu")], ["relu"])
    b = _shard(tmp_path / "b", 2, 2, [_row("relu", MISMATCH)], ["gelu"])
    assert main(["merge", a, b, "--reports", str(tmp_path / "m")]) == 2
    assert "case relu W=2 a=2 seed 0 is in two shards" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("other, needle", [
    ({"source": "s2"}, "ran other code or versions"),
    ({"total": 3}, "2 units of the selection's 3"),
])
def test_a_shard_of_another_run_or_a_missing_unit_is_refused(tmp_path, capsys, other, needle):
    a = _shard(tmp_path / "a", 1, 2, [_row("relu")], ["relu"], **other)
    b = _shard(tmp_path / "b", 2, 2, [_row("gelu")], ["gelu"], **{k: v for k, v in other.items() if k == "total"})
    assert main(["merge", a, b, "--reports", str(tmp_path / "m")]) == 2
    assert needle in capsys.readouterr().err


def test_a_missing_shard_is_refused(tmp_path, capsys):
    a = _shard(tmp_path / "a", 1, 2, [_row("relu")], ["relu"])
    assert main(["merge", a, "--reports", str(tmp_path / "m")]) == 2
    assert "shard 2/2 is missing" in capsys.readouterr().err


def test_merge_never_overwrites_files_verify_did_not_write(tmp_path, capsys):
    a = _shard(tmp_path / "a", 1, 2, [_row("relu")], ["relu"])
    b = _shard(tmp_path / "b", 2, 2, [_row("gelu")], ["gelu"])
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "report.json").write_text('{"mine": true}')
    assert main(["merge", a, b, "--reports", str(tmp_path / "m")]) == 2
    assert "report.json that verify did not write" in capsys.readouterr().err
    assert (tmp_path / "m" / "report.json").read_text() == '{"mine": true}'
