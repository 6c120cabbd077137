"""A single-device reference that is itself non-finite (a NaN or infinite loss, gradient or norm):
the model's own fault, so the row is an ``error`` naming the step and the model, never a verdict on
the plan (a MISMATCH against a NaN bound, or a MATCH of NaN against NaN)."""
from __future__ import annotations

import torch


class ModelNotFinite(RuntimeError):
    """The model itself, on one device, computes a non-finite loss, gradient or gradient norm."""


def _first_bad(value) -> float | None:
    """The first non-finite element of ``value`` (a tensor), or ``None``."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() and not value.is_complex():
        return None
    bad = ~torch.isfinite(value.detach())
    return float(value.detach()[bad].flatten()[0].real) if bool(bad.any()) else None


def require_finite(one: dict, step: int, where: str = "") -> dict:
    """``one``, a single-device step's results (``loss``/``loss64``, ``grads``/``grads64`` by
    parameter name, ``norm``/``norm64``), returned as it is; raise :class:`ModelNotFinite` naming
    the step (``where``: which run, e.g. ``" of the run resumed under tp at W=2"``), the tensor and
    the dtype where any of them is NaN or infinite."""
    named = [(k, what, one.get(k)) for k, what in (("loss", "loss"), ("loss64", "loss"), ("norm", "gradient norm"),
                                                    ("norm64", "gradient norm"))]
    for key in ("grads", "grads64"):
        named += [(key, f"gradient of {n}", g) for n, g in (one.get(key) or {}).items()]
    for key, what, value in named:
        bad = _first_bad(value)
        if bad is not None:
            raise ModelNotFinite(
                f"step {step}{where}: the model itself gives a non-finite {what} on one device ({bad} in "
                f"{str(value.dtype).removeprefix('torch.')}): the single-device reference is not a number, so no "
                f"plan can be judged against it; fix the model or its batch until one device trains it to finite values")
    return one
