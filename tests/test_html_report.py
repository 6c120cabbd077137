"""reports/report.html: self-contained, failing rows first with their rerun commands, a per-family
rollup and the error/tolerance plot; rendered by headless Chromium, the screenshot shows the red of
the failing rows' highlight and of the failure dots."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from verify.judge.verdict import MATCH, MISMATCH

from verify.cases.config import Row, RunConfig
from verify.report.html import FAIL_COLOR
from verify.report.writer import ReportWriter


def _rows() -> list[Row]:
    rows = [Row(f"op{i}", fam, "a b -> a b", 2, "a=2", "float32", 0, MATCH, 1e-7 * (i + 1), 1e-6, 1e-8, 1e-6)
            for i, fam in enumerate(["elementwise"] * 5 + ["linalg"] * 5)]
    rows.append(Row("model:nanogpt", "model", "nanogpt", 2, "tp", "float32", 0, MISMATCH, 3e-3, 1e-6, 1e-4, 1e-7,
                    "loss step 0 on rank 0: error 0.003 > tolerance 1e-06; first divergent operator: layer_norm_1",
                    "python -m verify model nanogpt --policy tp --world-size 2 --seed 0"))
    return rows


def test_report_html_is_written_with_failures_first(tmp_path):
    w = ReportWriter(tmp_path, RunConfig(world_sizes=(2,)))
    for r in _rows():
        w.add(r)
    w.close()
    page = (tmp_path / "report.html").read_text()
    assert page.index("Failing cases") < page.index("<svg") < page.index("Per family")
    assert "first divergent operator: layer_norm_1" in page and "python -m verify model nanogpt --policy tp" in page
    assert "<script" not in page and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert page.count("<circle") == len(_rows())


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_report_html_renders_the_failing_rows_and_the_plot(tmp_path):
    from PIL import Image

    w = ReportWriter(tmp_path, RunConfig(world_sizes=(2,)))
    for r in _rows():
        w.add(r)
    w.close()
    shot = tmp_path / "shot.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,900", f"file://{tmp_path / 'report.html'}"], check=True, capture_output=True,
                   timeout=120)
    img = Image.open(shot).convert("RGB")
    red = tuple(int(FAIL_COLOR[i:i + 2], 16) for i in (1, 3, 5))
    pink = (0xfd, 0xe8, 0xe8)  # the failing rows' background
    pixels = img.load()
    counts = {red: 0, pink: 0}
    for y in range(0, img.height, 2):
        for x in range(0, img.width, 2):
            p = pixels[x, y]
            for c in counts:
                if all(abs(a - b) <= 6 for a, b in zip(p, c)):
                    counts[c] += 1
    assert counts[pink] > 200, counts  # the failing row is highlighted
    assert counts[red] > 20, counts  # the tolerance line and the failure dot are drawn
