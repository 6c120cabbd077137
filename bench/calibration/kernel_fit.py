"""The cluster cost model's kernel constants fitted to kernels measured on the device
(``bench/results/h100_kernels.csv``, written by ``bench/calibration/gpu_kernels.py``): the GEMM curve
(``matmul_max``, ``matmul_half`` of :class:`nnscaler.profiles.ClusterConstants`) by least squares on
log efficiency over every measured GEMM, and the attention curve (``attention``, ``attention_half``) by least
squares on log efficiency over causal flash attention forward + backward.

Attention: the cost model charges a causal attention forward ``F / 2 / (peak * attention)`` (``F`` its
full-score FLOPs) and its backward ``BACKWARD`` (2) times that; ``gpu_kernels.py`` reports forward + backward
at ``3.5 * F / 2`` FLOPs (flash attention's backward recomputes the scores). So the constant that makes the
model's forward + backward time equal the measured one is ``(1 + BACKWARD) / 3.5 * rate / peak``, fitted as
``attention * F / (F + attention_half)`` of each call's full-score FLOPs ``F``.

    python bench/calibration/kernel_fit.py      # the table: measured vs model, calibrated constants vs kernel fit
"""
from __future__ import annotations

import csv
import dataclasses
import math
import statistics
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nnscaler.cost.compute import BACKWARD  # noqa: E402
from nnscaler.profiles import ClusterConstants  # noqa: E402

KERNELS = Path(__file__).resolve().parents[1] / "results" / "h100_kernels.csv"
FLASH_FWD_BWD = 3.5  # gpu_kernels.py's FLOPs of flash attention forward + backward, in forwards


def load(path: Path = KERNELS) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _gemms(rows):
    return [r for r in rows if r["kind"] == "gemm"]


def _attn(rows):
    return [r for r in rows if r["kind"] == "attention" and r["op"] == "sdpa_fwd_bwd"]


def model_rate(c: ClusterConstants, row: dict) -> float:
    """The rate (FLOP/s, as the CSV counts them) the cost model gives the kernel of ``row``."""
    if row["kind"] == "gemm":
        return c.peak * c.gemm_efficiency(float(row["m"]), float(row["n"]), float(row["k"]))
    return c.peak * c.attention_efficiency(attention_call_flops(row)) * FLASH_FWD_BWD / (1 + BACKWARD)


def attention_call_flops(row: dict) -> float:
    """Full-score forward FLOPs of a measured attention call (batch 1: ``4 s^2 d`` per head)."""
    s, d, heads = float(row["m"]), float(row["k"]), float(row["n"])
    return 4 * s * s * d * heads


def log_errors(c: ClusterConstants, rows) -> list[float]:
    """``log(model rate / measured rate)`` per row (positive: the model is too fast)."""
    return [math.log(model_rate(c, r) / (float(r["tflops"]) * 1e12)) for r in rows]


def fit(c: ClusterConstants, rows) -> ClusterConstants:
    """``c`` with ``matmul_max``, ``matmul_half`` and ``attention`` fitted to the measured ``rows``."""
    g = _gemms(rows)
    m, n, k = (np.array([float(r[x]) for r in g]) for x in ("m", "n", "k"))
    eff = np.array([float(r["tflops"]) * 1e12 / c.peak for r in g])
    intensity = 1.0 / (1.0 / m + 1.0 / n + 1.0 / k)

    def residual(p):
        return np.log(p[0] * intensity / (intensity + p[1])) - np.log(eff)
    sol = least_squares(residual, x0=[c.matmul_max, c.matmul_half], bounds=([0.05, 0.0], [1.0, 1e4]))
    a = _attn(rows)
    att = np.array([(1 + BACKWARD) / FLASH_FWD_BWD * float(r["tflops"]) * 1e12 / c.peak for r in a])
    calls = np.array([attention_call_flops(r) for r in a])

    def att_residual(p):  # the attention curve (ClusterConstants.attention_efficiency), half in GFLOP
        return np.log(p[0] * calls / (calls + p[1] * 1e9)) - np.log(att)
    asol = least_squares(att_residual, x0=[0.5, 50.0], bounds=([0.05, 0.0], [1.0, 1e5]))
    return dataclasses.replace(c, matmul_max=round(float(sol.x[0]), 3), matmul_half=round(float(sol.x[1]), 1),
                               attention=round(float(asol.x[0]), 3), attention_half=round(float(asol.x[1]), 1) * 1e9)


def table(before: ClusterConstants, after: ClusterConstants, rows) -> str:
    """Median and worst |model / measured - 1| of GEMMs and attention under both sets of constants."""
    out = [f"kernels ({len(_gemms(rows))} GEMMs, {len(_attn(rows))} attention fwd+bwd) measured on H100 vs the "
           f"cost model's rate", f"{'constants':<52} {'GEMM median':>11} {'worst':>7} {'attn median':>11} {'worst':>7}"]
    for name, c in (("in the profile (CALIBRATED)", before), ("fitted to the kernels", after)):
        ge = [abs(math.exp(e) - 1) for e in log_errors(c, _gemms(rows))]
        ae = [abs(math.exp(e) - 1) for e in log_errors(c, _attn(rows))]
        label = f"{name}: mm {c.matmul_max} half {c.matmul_half} attn {c.attention} / {c.attention_half / 1e9:.0f}G"
        out.append(f"{label:<52} {100 * statistics.median(ge):>10.1f}% {100 * max(ge):>6.1f}% "
                   f"{100 * statistics.median(ae):>10.1f}% {100 * max(ae):>6.1f}%")
    return "\n".join(out)


if __name__ == "__main__":
    from nnscaler.profiles import CALIBRATED
    rows = load()
    print(table(CALIBRATED["h100"], fit(CALIBRATED["h100"], rows), rows))
