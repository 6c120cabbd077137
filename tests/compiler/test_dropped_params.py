"""Parameters no output is computed from get no gradient on ranks, as on one device: the program
names them (``NO_GRAD``) and syncs none, so the optimizer leaves them alone (DeepSeek-V4 and
Hunyuan-V4 under dp synced zeros for them, and weight decay moved them). A ``torch.no_grad()``
region ends in a ``detach``: its results were used with their gradients (HRM's early cycles: every
rank's embedding gradient differed from one device's by 0.07)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


MODEL = Path(__file__).parents[1] / "fixtures" / "dropped_params.py"


def test_the_program_names_the_parameters_no_gradient_reaches(tmp_path):
    import importlib.util
    from nnscaler import ComputeConfig, plan_model
    from nnscaler.compile.plan import trace_model
    spec = importlib.util.spec_from_file_location("dropped_params", MODEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    case = mod.build(0)
    graph = trace_model(case.model, case.batch(0), None, registry=None, strict=False)
    reach = graph.reach_outputs()
    dropped = {t.target for t in graph.params if t not in reach}
    assert dropped == {f"{m}.{p}" for m in ("router", "compress", "warm", "target") for p in ("weight", "bias")}
    loss = case.model(*case.batch(0))
    loss.backward()
    assert all((p.grad is None) == (name in dropped) for name, p in case.model.named_parameters())
    assert plan_model(case.model, case.batch(0), "dp", ComputeConfig(2)) is not None


def test_it_trains_like_one_device_under_dp_and_tp():
    out = subprocess.run([sys.executable, "-m", "verify", "model", f"{MODEL}:build", "--policy", "dp", "tp",
                          "--world-size", "2"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "2 cases, 2 match" in out.stdout
