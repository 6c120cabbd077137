"""parallelize(verify=...): the plan's operator partitions are verified on the live ranks before any
code is generated; a wrong annotation is refused (strict) or warned (warn), with the operator and
the partition; verdicts are cached on disk so the second compile verifies nothing; a corrupt cache
is ignored."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler.dimops.binding import BoundAnno
from nnscaler.dimops.grammar import parse
from nnscaler.dimops.partition import Partition
from verify.plan.check import _load_cache
from verify.plan.shrink import reduced_sizes


def test_compile_only_what_passed(tmp_path):
    script = Path(__file__).parents[1] / "fixtures" / "verify_compile_script.py"
    (tmp_path / "verdicts.json").write_text("{not json")  # corrupt: ignored and rebuilt
    from verify.torchrun import command
    r = subprocess.run(command(["--nproc_per_node", "2", str(script), str(tmp_path)]),  # loopback-only torchrun
                       capture_output=True, text=True, timeout=300)
    out = r.stdout
    assert r.returncode == 0, out[-2000:] + r.stderr[-3000:]
    refused = next(line for line in out.splitlines() if line.startswith("STRICT"))
    assert refused.startswith("STRICT REFUSED") and "wrong_row_softmax" in refused and "b=2" in refused, refused
    default = next(line for line in out.splitlines() if line.startswith("DEFAULT"))
    assert default.startswith("DEFAULT REFUSED") and "wrong_row_softmax" in default, default
    warned = next(line for line in out.splitlines() if line.startswith("WARNED"))
    assert "wrong_row_softmax" in warned, warned
    cold = next(line for line in out.splitlines() if line.startswith("COLD")).split()
    warm = next(line for line in out.splitlines() if line.startswith("WARM")).split()
    assert cold[-1] == "[]" and warm[-1] == "[]", out  # nanoGPT's plan passes, no warning
    cache = _load_cache(tmp_path / "verdicts.json")
    assert len(cache) >= int(cold[2]) and all(v["ok"] for v in cache.values() if v["spec"] != "wrong_row_softmax")


def test_replicas_take_the_verdicts_of_the_plan_ranks(tmp_path):
    script = Path(__file__).parents[1] / "fixtures" / "verify_replicas_script.py"
    from verify.torchrun import command
    r = subprocess.run(command(["--nproc_per_node", "4", str(script), str(tmp_path)]),
                       capture_output=True, text=True, timeout=600)
    out = r.stdout
    assert r.returncode == 0, out[-2000:] + r.stderr[-3000:]
    for rank in range(4):  # every rank refuses the wrong op, every rank compiles the right model
        found = (tmp_path / f"rank{rank}.txt").read_text()
        refused = next(line for line in found.splitlines() if line.startswith(f"RANK {rank} STRICT"))
        assert "REFUSED" in refused and "wrong_row_softmax" in refused and "b=2" in refused, refused
        assert f"RANK {rank} TRAINED" in found, found
    cache = _load_cache(tmp_path / "verdicts.json")
    assert cache and any(not v.get("ok", True) and v["spec"] == "wrong_row_softmax" for v in cache.values())


def test_every_stage_of_a_pipeline_is_verified(tmp_path):
    """parallelize(verify=...) of a pipeline (2 stages x tp 2): a wrong op in the second stage is refused
    under strict and warned under warn on every rank; a right pipeline compiles under strict."""
    script = Path(__file__).parents[1] / "fixtures" / "verify_pipeline_script.py"
    from verify.torchrun import command
    root = str(Path(__file__).parents[2])  # this checkout's nnscaler, whatever is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(command(["--nproc_per_node", "4", str(script), str(tmp_path)]),
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for rank in range(4):
        found = (tmp_path / f"rank{rank}.txt").read_text()
        refused = next(line for line in found.splitlines() if line.startswith(f"RANK {rank} STRICT"))
        assert "REFUSED" in refused and "wrong_row_softmax" in refused and "b=2" in refused, refused
        warned = next(line for line in found.splitlines() if line.startswith(f"RANK {rank} WARNED"))
        assert "wrong_row_softmax" in warned, warned
        assert f"RANK {rank} TRAINED" in found, found


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=6), st.data())
def test_reduced_lengths_keep_order_equality_and_divisibility(lengths, data):
    idents = [f"i{k}" for k in range(len(lengths))]
    sizes = dict(zip(idents, lengths))
    splits = []
    for ident, n in sizes.items():
        f = data.draw(st.sampled_from([f for f in (2, 3, 4) if n % f == 0] or [1]))
        if f > 1 and data.draw(st.booleans()):
            splits.append((ident, f))
    bound = BoundAnno(parse(" ".join(idents) + " -> " + " ".join(idents)), sizes, ((tuple((i,) for i in idents)),),
                      ((tuple((i,) for i in idents)),))
    part = Partition(tuple(splits), max(1, math.prod(f for _, f in splits)))
    small = reduced_sizes(bound, part)
    for i in idents:
        assert small[i] <= sizes[i] and small[i] % part.factor(i) == 0
        assert (small[i] < 2) == (sizes[i] < 2)
        for j in idents:
            assert (sizes[i] < sizes[j]) == (small[i] < small[j]) and (sizes[i] == sizes[j]) == (small[i] == small[j])


def test_pair_keys_are_the_same_in_every_process():
    """Ranks decide what to verify by key: a key that differs between processes (a repr holding a
    memory address) would make each rank run other pairs, and never hit the cache across runs."""
    code = ("import sys, warnings; warnings.simplefilter('ignore'); sys.path.insert(0, 'tests/fixtures')\n"
            "import opzoo, wrong_model\n"
            "from nnscaler.trace.build import trace\nfrom nnscaler.policies import POLICIES, ComputeConfig\n"
            "from verify.models.registry import MODELS\nfrom verify.plan.check import plan_pairs\n"
            "for name in ('wrong_softmax_head', 'nanogpt'):\n"
            "    case = MODELS[name](0); g = trace(case.model, case.batch(0))\n"
            "    for k, p in plan_pairs(g, POLICIES['tp'](g, ComputeConfig(2)), 'float32').items():\n"
            "        print(name, p.op.name, k, p.full_key)\n")
    root = Path(__file__).resolve().parents[2]
    runs = [subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout.splitlines()) > 10
