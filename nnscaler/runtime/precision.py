"""Precision recipes (``ComputeConfig(precision=...)``, PyTorch Lightning's names):

* ``"32-true"``: everything fp32 (the default).
* ``"bf16-mixed"``: fp32 parameters (the master weights), fp32 gradients and optimizer state; every
  operator computes in the dtype it computes in on one device under ``torch.autocast(device, bf16)``
  (matmuls and linears in bf16, cross-entropy and the other autocast fp32 ops in fp32). The compiled
  program does it with explicit casts (:mod:`nnscaler.trace.amp` records what autocast does to each
  traced operator; :func:`nnscaler.compile.precision.apply_precision` marks the operators; the emitter writes ``x.to(dtype)``)
  and runs with autocast off, so partition-aware kernels compute in the same dtype as the one
  operator they replace. Gradients are reduced in fp32 unless ``grad_reduce_dtype="bf16"``.
  Its single-device reference: the same model under ``torch.autocast(device, dtype=torch.bfloat16)``.
* ``"bf16-true"``: parameters, buffers, floating inputs and optimizer state in bf16: ``parallelize``
  converts the model to bf16 in place (as Lightning does) before tracing; its reference is
  ``model.to(torch.bfloat16)`` on one device.

An ``autocast`` put by hand around a module compiled as ``32-true`` is refused (:func:`autocast_message`,
:class:`PrecisionError`): the traced program does not see it, and would run autocast's fp32 operators in bf16."""
from __future__ import annotations

import torch

from ..recipe import PRECISIONS  # noqa: F401 (the names, with the recipe's fields; importers find them here too)

GRAD_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the names of Recipe.grad_reduce_dtype's flag


class PrecisionError(ValueError):
    """A call the compiled module refuses for its precision: a hand-made ``torch.autocast`` around a
    module compiled without ``bf16-mixed`` (:func:`autocast_message` says why)."""


def device_type() -> str:
    """The accelerator this process would use if it had to pick one (for option checks made before
    any tensor exists); what a program computes on is :func:`tensors_device_type`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def tensors_device_type(tensors) -> str:
    """The device type of the first tensor in ``tensors`` ("cpu" if none): the device autocast must
    name, since ``torch.autocast("cuda")`` leaves CPU tensors alone (a gang of gloo ranks on a machine
    that also has a GPU computes on the CPU)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def autocast_run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under ``torch.autocast(bf16)`` on its tensors' device: a bf16-mixed
    program runs a custom operator (``torch.library``'s, the catalogue's, a user's) this way, since on
    one device autocast has no rule for the operator itself but stays on inside its implementation,
    whose linears then compute in bf16 (with autocast off the program computed them in fp32: MoE
    experts' router gradients 3-13% off)."""
    kind = tensors_device_type(a for a in args if isinstance(a, torch.Tensor))
    with torch.autocast(kind, dtype=torch.bfloat16):
        return fn(*args, **kwargs)


def bf16_supported(kind: str | None = None) -> bool:
    """Whether the device this process runs on has bf16 kernels (every CPU build has them)."""
    kind = kind or device_type()
    if kind == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return True


def autocast_on() -> str | None:
    """The device type of an enabled ``torch.autocast`` around the caller, if any."""
    for kind in ("cpu", "cuda"):
        if torch.is_autocast_enabled(kind):
            return kind
    return None


def autocast_message(precision: str) -> str | None:
    """Why a hand-made ``torch.autocast`` around a module compiled as ``precision`` is refused (None: it
    is not on, or the module is ``bf16-mixed``, whose program casts explicitly and runs with it off)."""
    kind = autocast_on()
    if kind is None or precision == "bf16-mixed":
        return None
    return (f"torch.autocast({kind!r}) around a module compiled with precision={precision!r} would run "
            f"autocast's fp32 operators (softmax, cross-entropy) in bf16; compile with "
            f"ComputeConfig(precision='bf16-mixed') and call it without autocast")
