"""Element-wise operators: unary math, binary ops (same shape, broadcast, with a scalar), ternary
ops and comparisons. Every dim is spatially splittable: each output element depends only on the
input elements at the same position, so the plain op on the shards is the op on the whole."""
from __future__ import annotations

import torch

from nnscaler import Positive, Uniform, register_op

FAMILY = "elementwise"


def _reg(name, annotation, fn, aten, **options):
    register_op(annotation, name, family=FAMILY, aten=aten, **options)(fn)


# --- unary: torch.NAME, aten.NAME.default; value constraint where the domain is restricted ------
_POS, _UNIT = Positive(), Uniform(-0.9, 0.9)
UNARY = {
    "abs": None, "neg": None, "exp": None, "exp2": None, "expm1": None, "log": _POS, "log2": _POS,
    "log10": _POS, "log1p": _POS, "sqrt": _POS, "rsqrt": _POS, "reciprocal": _POS, "square": None,
    "sin": None, "cos": None, "tan": _UNIT, "asin": _UNIT, "acos": _UNIT, "atan": None, "sinh": None,
    "cosh": None, "asinh": None, "atanh": _UNIT, "erf": None, "erfinv": _UNIT, "sign": None,
}
for _name, _c in UNARY.items():
    _reg(_name, "* -> *", getattr(torch, _name), f"aten.{_name}.default",
         inputs={0: _c} if _c is not None else None)

_reg("clamp", "* -> *", torch.clamp, "aten.clamp.default", kwargs={"min": -0.5, "max": 0.5})

# --- binary, same shape -------------------------------------------------------------------------
BINARY = {  # name: (fn, aten overload, constraints)
    "add": (torch.add, "aten.add.Tensor", None),
    "sub": (torch.sub, "aten.sub.Tensor", None),
    "mul": (torch.mul, "aten.mul.Tensor", None),
    "div": (torch.div, "aten.div.Tensor", {1: _POS}),
    "maximum": (torch.maximum, "aten.maximum.default", None),
    "minimum": (torch.minimum, "aten.minimum.default", None),
    "pow": (torch.pow, "aten.pow.Tensor_Tensor", {0: _POS}),
    "atan2": (torch.atan2, "aten.atan2.default", {1: _POS}),
    "hypot": (torch.hypot, "aten.hypot.default", None),
}
for _name, (_fn, _aten, _c) in BINARY.items():
    _reg(_name, "*, * -> *", _fn, _aten, inputs=_c)

# --- binary with broadcasting: a trailing vector, a row (1 b) and a column (a 1) ------------------
for _name in ("add", "sub", "mul", "div"):
    _fn, _aten, _c = BINARY[_name]
    _reg(f"{_name}_bcast", "* n, n -> * n", _fn, _aten, inputs=_c)
_reg("add_row", "a b, 1 b -> a b", torch.add, "aten.add.Tensor")
_reg("mul_col", "a b, a 1 -> a b", torch.mul, "aten.mul.Tensor")
_reg("div_col", "a b, a 1 -> a b", torch.div, "aten.div.Tensor", inputs={1: _POS})

# --- with a Python scalar -----------------------------------------------------------------------
SCALAR = {  # name: (fn, aten overload, scalar)
    "add_scalar": (torch.add, "aten.add.Tensor", 2.5),
    "sub_scalar": (torch.sub, "aten.sub.Tensor", 1.5),
    "mul_scalar": (torch.mul, "aten.mul.Tensor", 0.5),
    "div_scalar": (torch.div, "aten.div.Tensor", 3.0),
    "rsub_scalar": (torch.rsub, "aten.rsub.Scalar", 1.0),
    "pow_scalar": (torch.pow, "aten.pow.Tensor_Scalar", 3.0),
}
for _name, (_fn, _aten, _s) in SCALAR.items():
    _reg(_name, "*, ? -> *", _fn, _aten, args={1: _s})
_reg("pow_scalar_base", "?, * -> *", torch.pow, "aten.pow.Scalar", args={0: 2.0})

# --- ternary ------------------------------------------------------------------------------------
_reg("addcmul", "*, *, * -> *", torch.addcmul, "aten.addcmul.default", kwargs={"value": 0.5})
_reg("addcdiv", "*, *, * -> *", torch.addcdiv, "aten.addcdiv.default", kwargs={"value": 0.5},
     inputs={2: _POS})
_reg("lerp", "*, *, ? -> *", torch.lerp, "aten.lerp.Scalar", args={2: 0.3})

# --- comparisons (boolean results, no gradient) ---------------------------------------------------
for _name in ("gt", "lt", "ge", "le"):
    _reg(_name, "*, * -> *", getattr(torch, _name), f"aten.{_name}.Tensor", differentiable=False)
