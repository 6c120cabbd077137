"""The tolerance policy, stated once.

For every compared tensor (each output, and the gradient of each floating input) there are three
versions: the parallel result ``par`` (in the dtype under test), the single-device result ``dev``
(same dtype) and the single-device float64 result ``ref``. With ``err(x) = max |x - ref|`` over the
finite elements of ``ref``:

    pass  iff  err(par) <= FACTOR * err(dev) + FLOOR_EPS * eps(dtype) * max|ref|

* ``FACTOR = 4``: a parallel program may reorder sums, so it may lose a little more than one device,
  but not orders of magnitude more.
* ``FLOOR_EPS = 16``: where one device happens to be exact (``err(dev) == 0``), a reordered sum still
  may round; sixteen units in the last place of the largest value allow for that. eps is 2.2e-16
  (float64), 1.2e-7 (float32), 9.8e-4 (float16), 7.8e-3 (bfloat16).
* Positions where ``ref`` is NaN or infinite must be the same NaN/inf in ``par``; a NaN or inf in
  ``par`` where ``ref`` is finite fails, whatever the numbers.
* Integer and boolean tensors must be equal; shapes and dtypes must match.
* Whole models measure the floor of a gradient against the largest gradient of that step (``scale``):
  a gradient that vanishes in exact arithmetic (a key bias under softmax) is rounding noise of terms
  as large as the others.
* Whole models compare parameters after optimizer steps with ``STATE_FACTOR = 16`` instead of 4: Adam
  divides each update by the root of its second moment, so a rounding difference in a gradient close
  to zero becomes a large relative difference in its update, on one device as in parallel; the
  per-element maximum of that amplified noise is heavy-tailed. A wrong partition moves parameters by
  the order of the learning rate, far above either bound.

Wrong partitions give errors of the order of the values themselves, far beyond these bounds; the
float64 calibration is what lets the bounds stay tight in float32 and bfloat16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FACTOR = 4.0
FLOOR_EPS = 16.0
STATE_FACTOR = 16.0  # parameters after optimizer steps: Adam divides by sqrt(v), amplifying rounding


@dataclass(frozen=True)
class Check:
    """The verdict on one tensor: its error against float64, the bound it had to meet."""

    name: str
    err: float
    tol: float
    ok: bool
    reason: str = ""

    @property
    def ratio(self) -> float:
        if not self.ok and self.err == 0:
            return float("inf")
        return self.err / self.tol if self.tol > 0 else (0.0 if self.err == 0 else float("inf"))


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def check_tensor(name: str, par, dev, ref, factor: float = FACTOR, floor_eps: float = FLOOR_EPS,
                 scale: float | None = None) -> Check:
    """Judge ``par`` against the float64 ``ref``, calibrated by the single-device ``dev``; ``scale``
    replaces ``max|ref|`` in the floor (whole models pass the largest gradient of the step, since a
    gradient that is zero in exact arithmetic is pure rounding noise of larger terms)."""
    if par is None or dev is None:
        if par is None and dev is None:
            return Check(name, 0.0, 0.0, True)
        return Check(name, float("inf"), 0.0, False, "missing on one side (one gives None, the other a tensor)")
    if not isinstance(par, torch.Tensor):
        ok = par == dev
        return Check(name, 0.0 if ok else float("inf"), 0.0, ok, "" if ok else f"{par!r} != {dev!r}")
    if tuple(par.shape) != tuple(dev.shape):
        return Check(name, float("inf"), 0.0, False, f"shape {tuple(par.shape)} != {tuple(dev.shape)}")
    if par.dtype != dev.dtype:
        return Check(name, float("inf"), 0.0, False, f"dtype {par.dtype} != {dev.dtype}")
    if not (par.is_floating_point() or par.is_complex()):
        bad = int((par != dev).sum())
        return Check(name, float(bad), 0.0, bad == 0, f"{bad} of {par.numel()} elements differ" if bad else "")
    wide = torch.complex128 if par.is_complex() else torch.float64  # complex: compared whole, not its real part
    par64, dev64, ref = par.to(wide), dev.to(wide), ref.to(wide)
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(par64), finite) or not torch.equal(par64[~finite].nan_to_num(), ref[~finite].nan_to_num()):
        bad = int((torch.isfinite(par64) != finite).sum())
        return Check(name, float("inf"), 0.0, False, f"NaN/inf in {bad} places where the reference differs")
    err = _max_abs((par64 - ref)[finite])
    err_dev = _max_abs((dev64 - ref)[finite])
    eps = torch.finfo(par.dtype).eps
    tol = factor * err_dev + floor_eps * eps * (_max_abs(ref[finite]) if scale is None else scale)
    return Check(name, err, tol, err <= tol, "" if err <= tol else f"error {err:.3g} > tolerance {tol:.3g}")
