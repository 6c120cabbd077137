"""The recipe a whole-model case runs under (``verify model --precision``), as the harness's stages
need it: the compiled module's ``ComputeConfig`` options (:func:`config_kwargs`), the single-device
reference run the same way (:func:`reference`), and the verdict rule (:func:`active`: the low-
precision bound of :mod:`verify.judge.compare`).

``bf16-mixed``: the reference is the single-device model under ``torch.autocast(device, bfloat16)``
(fp32 parameters); ``bf16-true``: the model cast to bf16 (the harness's ``--dtype bfloat16`` path,
the compiled module holding bf16 state). The float64 reference stays float64: autocast leaves
float64 tensors alone, so the same hooks on a float64 copy change nothing."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nnscaler.runtime.precision import PRECISIONS, tensors_device_type

from verify.judge.dtypes import convert, to_dtype


@dataclass(frozen=True)
class Precision:
    """The recipe of one whole-model case, passed explicitly to each stage that needs it."""

    precision: str = "32-true"
    grad_reduce_dtype: str | None = None

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; valid: {', '.join(PRECISIONS)}")

    @classmethod
    def of(cls, recipe) -> "Precision":
        """The precision part of a training recipe (:class:`nnscaler.recipe.Recipe`)."""
        return cls(recipe.precision, recipe.grad_reduce_dtype)

    @property
    def active(self) -> bool:
        """Whether the verdict is the low-precision rule (a bf16 recipe)."""
        return self.precision != "32-true"

    def config_kwargs(self) -> dict:
        """The recipe's ``ComputeConfig`` options, for every module the case compiles."""
        if not self.active:
            return {}
        return {"precision": self.precision, **({"grad_reduce_dtype": self.grad_reduce_dtype}
                                               if self.grad_reduce_dtype else {})}

    def reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (a single-device reference) made to run the recipe: under ``bf16-mixed`` its forward
        runs under ``torch.autocast(device, bfloat16)`` (hooks)."""
        if self.precision == "bf16-mixed" and not getattr(model, "_verify_autocast_hooked", False):
            model.register_forward_pre_hook(_enter)
            model.register_forward_hook(_exit, always_call=True)
            model._verify_autocast_hooked = True
        return model


def _enter(module, args):
    ctx = torch.autocast(tensors_device_type(module.parameters()), dtype=torch.bfloat16)
    ctx.__enter__()
    module._verify_autocast = getattr(module, "_verify_autocast", []) + [ctx]


def _exit(module, args, output):
    module._verify_autocast.pop().__exit__(None, None, None)


_NO_BF16 = ("bfloat16", "low precision dtypes not supported")


def precheck(model: torch.nn.Module, args: tuple, precision: str) -> str | None:
    """One forward of the single-device ``model`` (the parent's inspection build, converted in place
    for ``bf16-true``) under ``precision`` on ``args``, before any rank starts: the first line of the
    error of an operator without a bf16 kernel on this device, or None. Other errors are left to the
    cases, which report them as rows."""
    if precision == "32-true":
        return None
    try:
        with torch.no_grad():
            if precision == "bf16-true":
                to_dtype(model, torch.bfloat16)
                model(*(convert(a, torch.bfloat16) for a in args))
            else:
                with torch.autocast(tensors_device_type(model.parameters()), dtype=torch.bfloat16):
                    model(*args)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        line = (str(exc).strip().splitlines() or [""])[0]
        if any(k in line.lower() for k in _NO_BF16):
            return f"{type(exc).__name__}: {line}"
    return None
