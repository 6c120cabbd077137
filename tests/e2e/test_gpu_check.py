"""``bench/gpu_check.py`` where no GPU is lent: one line saying it skipped and why, exit 0, nothing written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the script would measure it")
def test_gpu_check_without_a_gpu_skips_in_one_clear_line(tmp_path):
    out = tmp_path / "gpu.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: skipped: no CUDA device (")
    assert not out.exists() and not list((ROOT / "bench" / "results").glob("gpu_cpu*.md"))
