"""reports/report.html: self-contained, failing rows first with their rerun commands, a per-family
rollup and the error/tolerance plot; rendered by headless Chromium, the screenshot shows the red of
the failing rows' highlight and of the failure dots."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from verify.judge.verdict import MATCH, MISMATCH

from verify.config import RunConfig

from verify.judge.row import Row
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


def _localized_row() -> Row:
    """A model row as the ranks localise it: a conversion that drops a gradient sum, with its profile."""
    divergence = {"op": "matmul_4", "overload": "aten.matmul.default, registered as rule.matmul",
                  "source": "speech.py:67: scores = torch.matmul(q, k.transpose(2, 3))", "partition": "m=2",
                  "direction": "backward", "err": 2.88e-3, "tol": 2.29e-6, "rerun": "", "where": "",
                  "kind": "conversion", "tensor": "transpose_13", "input_index": 1,
                  "layouts": "reads q R (as held), transpose_13 R (from D3: all_gather(axis 0, dims 3)) -> writes matmul_4 D0",
                  "conversion": "transpose_13 D3 -> R for matmul_4 input 1 (consumer splits m per mesh axis), steps: "
                                "all_gather(axis 0, dims 3); its gradient comes back V and must leave D3", "reason": ""}
    profile = [[f"t{i}", "F", 1e-8 * (i + 1), 1e-6] for i in range(30)]
    profile += [["transpose_13#7", "B", 2.88e-3, 2.29e-6]] + [[f"g{i}", "B", 1e-3, 1e-6] for i in range(3)]
    profile += [[f"h{i}", "B", 1e-9, 1e-6] for i in range(10)]
    return Row("model:speech_encdec", "model", "1 AdamW steps vs one device", 2, "random", "float32", 0, MISMATCH,
               1e-7, 1e-6, 5.66e-3, 2.32e-6, "grad conv1.weight step 0 on rank 0: error 0.00566 > tolerance 2.32e-06",
               "python -m verify model speech_encdec --policy random --world-size 2 --seed 0 --dtype float32",
               localization={"divergence": divergence, "text": "first divergent conversion: ...", "alone": "",
                             "note": "", "profile": profile})


def _operator_row() -> Row:
    row = _localized_row()
    d = dict(row.localization["divergence"], kind="operator", op="layer_norm_1", direction="forward",
             rerun="python -m verify op --model nanogpt --node layer_norm_1 --world-size 2 --partition c=2 --seed 0 "
                   "--dtype float32", conversion="")
    alone = d["rerun"] + " --module wrong_norm_rules.py"
    return Row("model:nanogpt", "model", "x", 2, "random", "float32", 1, MISMATCH, 1.0, 1e-6, None, None, "d", "r",
               localization={"divergence": d, "text": "", "alone": alone, "note": "", "profile": []})


def test_report_html_shows_each_mismatching_rows_localisation_and_profile(tmp_path):
    w = ReportWriter(tmp_path, RunConfig(world_sizes=(2,)))
    rows = _rows() + [_localized_row(), _operator_row()]
    note = Row("model:nanogpt", "model", "x", 2, "dp", "float32", 0, MISMATCH, 1.0, 0.0, None, None, "forced", "r",
               localization={"divergence": None, "text": "", "alone": "", "note": "every tensor of the program matches",
                             "profile": [["a", "F", 0.0, 1e-6], ["a", "B", 1e-8, 1e-6]]})
    for r in rows + [note]:
        w.add(r)
    w.close()
    page = (tmp_path / "report.html").read_text()
    failing = page[page.index("Failing cases"):page.index("How close every case")]
    loc = failing[failing.index("model:speech_encdec"):failing.index("model:nanogpt", failing.index("model:speech_encdec"))]
    for text in ("transpose_13 D3 -&gt; R for matmul_4 input 1", "speech.py:67: scores = torch.matmul(q, k.transpose(2, 3))",
                 "m=2", "reads q R (as held)", "0.00288 / 2.29e-06 (1.26e+03x)",
                 "gradient (backward)", "the row's rerun reproduces it", "<polyline",
                 "along the program: 30 values forward, then 14 gradients backward; 4 beyond the bound"):
        assert text in loc, text
    assert loc.index("transpose_13#7") < loc.index("g0")  # the first beyond its bound leads the table, before the worse-or-equal rest
    assert loc.count(f'fill="{FAIL_COLOR}"/>') == 4 and loc.count("<circle") == 4  # each tensor beyond its bound
    op = failing[failing.index("layer_norm_1"):]
    assert "--node layer_norm_1" in op and "--dtype float32 --module wrong_norm_rules.py" in op
    assert "every tensor of the program matches" in failing
    assert "<script" not in page
