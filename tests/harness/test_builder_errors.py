"""A user's builder that raises (on import, when called, in its batch function) is one line on stderr
naming what raised, the exception and the user's line, exit 2, before any rank starts."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CASES = {
    "import": ("raise RuntimeError('no such dataset')\n", "importing", "RuntimeError: no such dataset", 1),
    "builder": ("def build(seed):\n    raise ValueError('width must be even')\n", "the builder build(0) raised",
                "ValueError: width must be even", 2),
    "batch": ("import torch\ndef build(seed):\n    return torch.nn.Linear(2, 1), lambda step: 1 / 0\n",
              "batch_fn(0) raised", "ZeroDivisionError", 3),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_a_raising_builder_is_one_line_and_exit_2(kind, tmp_path):
    source, what, exc, line = CASES[kind]
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(source))
    out = subprocess.run([sys.executable, "-m", "verify", "model", f"{path}:build", "--policy", "dp",
                          "--world-size", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert what in lines[0] and exc in lines[0] and f"my_model.py:{line}" in lines[0], lines[0]
