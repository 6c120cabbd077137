"""parallelize(verify=...): the plan's operator partitions are verified on the live ranks before any
code is generated; a wrong annotation is refused (strict) or warned (warn), with the operator and
the partition; verdicts are cached on disk so the second compile verifies nothing; a corrupt cache
is ignored."""
from __future__ import annotations

import subprocess
from pathlib import Path

from verify.plan_check import _load_cache


def test_compile_only_what_passed(tmp_path):
    script = Path(__file__).parent / "fixtures" / "verify_compile_script.py"
    (tmp_path / "verdicts.json").write_text("{not json")  # corrupt: ignored and rebuilt
    from verify.torchrun import command
    r = subprocess.run(command(["--nproc_per_node", "2", str(script), str(tmp_path)]),  # loopback-only torchrun
                       capture_output=True, text=True, timeout=300)
    out = r.stdout
    assert r.returncode == 0, out[-2000:] + r.stderr[-3000:]
    refused = next(line for line in out.splitlines() if line.startswith("STRICT"))
    assert refused.startswith("STRICT REFUSED") and "wrong_row_softmax" in refused and "b=2" in refused, refused
    warned = next(line for line in out.splitlines() if line.startswith("WARNED"))
    assert "wrong_row_softmax" in warned, warned
    cold = next(line for line in out.splitlines() if line.startswith("COLD")).split()
    warm = next(line for line in out.splitlines() if line.startswith("WARM")).split()
    assert cold[-1] == "[]" and warm[-1] == "[]", out  # nanoGPT's plan passes, no warning
    cache = _load_cache(tmp_path / "verdicts.json")
    assert len(cache) >= int(cold[2]) and all(v["ok"] for v in cache.values() if v["spec"] != "wrong_row_softmax")
