"""The one dtype conversion of a user's model and inputs, for the runs and the float64 reference.

It changes only what it must: real floating tensors take the run's dtype; complex tensors the complex
dtype of the same precision (float32 -> complex64, float64 -> complex128; bf16/fp16 runs keep complex64,
torch's narrowest usable complex); integer and boolean tensors stay as they are. ``nn.Module.to(float32)``
drops the imaginary part of a complex buffer (a RoPE cache made by ``torch.polar``) while ``.double()``
leaves it complex: the runs and the reference then computed different models and the bound silently
grew (torchtitan's Llama: 1.6e-7 to 4.5e-4 on a correct tp run). Every path converts through here."""
from __future__ import annotations

import torch

COMPLEX_OF = {torch.float64: torch.complex128, torch.float32: torch.complex64}  # others: complex64


def complex_of(dtype: torch.dtype) -> torch.dtype:
    """The complex dtype a run in real ``dtype`` holds its complex tensors in."""
    return COMPLEX_OF.get(dtype, torch.complex64)


def convert(x, dtype: torch.dtype):
    """``x`` in the run's ``dtype`` as this module's docstring says (non-tensors as they are)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_floating_point():
        return x.to(dtype)
    if x.is_complex():
        return x.to(complex_of(dtype))
    return x


def to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model``, converted in place (parameters, gradients and buffers) by :func:`convert`; returned."""
    return model._apply(lambda t: convert(t, dtype))


def convert_state(state: dict, dtype: torch.dtype) -> dict:
    """A state dict's tensors converted by :func:`convert`."""
    return {k: convert(v, dtype) for k, v in state.items()}
