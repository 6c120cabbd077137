"""A compiled module's ``state_dict`` lists what the model's own does: non-persistent buffers (RoPE
tables) stay out, so a plain model's strict ``load_state_dict`` takes it; ``whole_state`` still holds
them (the harness compares the buffers a forward writes through it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import os, sys, tempfile
import torch
import torch.distributed as dist
from nnscaler import ComputeConfig, parallelize

os.environ["GLOO_SOCKET_IFNAME"] = "lo"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)


class Rope(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0), persistent=False)  # as a RoPE cache is
        self.register_buffer("count", torch.zeros(8))

    def forward(self, x):
        return (self.lin(x) * self.table + self.count).sum()


torch.manual_seed(0)
model = Rope()
pm = parallelize(model, (torch.randn(4, 8),), "dp", ComputeConfig(1), gen_savedir=tempfile.mkdtemp(), verify=False)
assert sorted(pm.state_dict()) == sorted(model.state_dict()) == ["count", "lin.bias", "lin.weight"], sorted(pm.state_dict())
assert "table" in pm.whole_state()
plain = Rope()
plain.load_state_dict(pm.state_dict(), strict=True)  # refused while the table was in it
pm.load_state_dict(model.state_dict(), strict=True)
try:
    pm.load_state_dict({k: v for k, v in model.state_dict().items() if k != "count"}, strict=True)
except RuntimeError as exc:
    assert "missing ['count']" in str(exc), exc
else:
    raise AssertionError("a missing persistent buffer was not refused")
print("OK")
'''


def test_state_dict_leaves_out_non_persistent_buffers():
    from verify.runner.gang import free_port
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
