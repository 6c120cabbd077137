"""Rules for element-wise ops of any arity, with broadcasting and Python scalars.

Every tensor argument is aligned from the right against the broadcast output: a shared identifier
per output dim, ``1`` where a tensor broadcasts (``c, a b c -> a b c``, ``a 1 c, a b c -> a b c``);
scalars and other non-tensor arguments are ``?``. Every dim is spatial: an output element depends
only on the input elements at its own position. Casts (``to``, ``_to_copy``) are element-wise too;
a ``device`` argument is dropped (placing tensors is the runtime's business). ``dropout`` that
draws (``p > 0`` in training) runs a kernel that draws the whole tensor's mask on every rank and
keeps its slice, so its masks are one device's (the harness runs each forward from one generator
state: ``verify.cases.draws``).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from nnscaler.ops import OpCall, Positive, TensorMeta, Uniform, annotation_rule, aten_overload

from .. import kernels as K
from ..rulekit import Names, broadcast, build, usable

FAMILY = "elementwise"

_POS, _UNIT = Positive(), Uniform(-0.9, 0.9)
UNARY = {  # aten op name: sample constraint of its input (None: any value)
    "abs": None, "neg": None, "exp": None, "exp2": None, "expm1": None, "log": _POS, "log2": _POS,
    "log10": _POS, "log1p": _POS, "sqrt": _POS, "rsqrt": _POS, "reciprocal": _POS, "square": None,
    "sin": None, "cos": None, "tan": _UNIT, "asin": _UNIT, "acos": _UNIT, "atan": None, "sinh": None,
    "cosh": None, "asinh": None, "atanh": _UNIT, "erf": None, "erfinv": _UNIT, "sign": None,
    "relu": None, "gelu": None, "silu": None, "sigmoid": None, "tanh": None, "leaky_relu": None,
    "elu": None, "softplus": None, "mish": None, "hardtanh": None, "hardswish": None,
    "hardsigmoid": None, "log_sigmoid": None, "clamp": None, "clamp_min": None, "clamp_max": None,
    "clone": None, "contiguous": None, "alias": None, "logical_not": None, "bitwise_not": None,
    "isnan": None, "isinf": None, "isfinite": None, "floor": None, "ceil": None, "round": None,
    "trunc": None, "frac": None, "sgn": None, "detach": None, "lift_fresh_copy": None,
}
UNARY_OVERLOADS = [f"aten.{n}.default" for n in UNARY] + [
    "aten.clamp.Tensor", "aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default"]
BINARY_OVERLOADS = [
    "aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar", "aten.rsub.Tensor",
    "aten.rsub.Scalar", "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar",
    "aten.div.Tensor_mode", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.pow.Scalar",
    "aten.maximum.default", "aten.minimum.default", "aten.max.other", "aten.min.other", "aten.atan2.default", "aten.hypot.default",
    "aten.fmod.Tensor", "aten.fmod.Scalar", "aten.remainder.Tensor", "aten.remainder.Scalar",
    "aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.where.Scalar",
    "aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.lerp.Scalar", "aten.lerp.Tensor",
    "aten.addcmul.default", "aten.addcdiv.default", "aten.logical_and.default", "aten.logical_or.default",
    "aten.logical_xor.default", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
    "aten.bitwise_xor.Tensor", "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.__xor__.Tensor",
    "aten.floor_divide.default", "aten.floor_divide.Scalar",
] + [f"aten.{c}.{k}" for c in ("eq", "ne", "lt", "le", "gt", "ge") for k in ("Tensor", "Scalar")]
# in-place forms, run out of place (the traced graph reads the in-place op's result afterwards)
INPLACE_OVERLOADS = [f"aten.{op}_.{k}" for op in ("add", "sub", "mul", "div") for k in ("Tensor", "Scalar")]

# positive sample values where the op needs them (the divisor, the base of a power, ...)
POSITIVE_ARG = {"aten.div.Tensor": 1, "aten.div.Tensor_mode": 1, "aten.pow.Tensor_Scalar": 0,
                "aten.pow.Tensor_Tensor": 0, "aten.atan2.default": 1, "aten.fmod.Tensor": 1,
                "aten.remainder.Tensor": 1, "aten.addcdiv.default": 2, "aten.floor_divide.default": 1}


def _constraints(call: OpCall) -> dict:
    op = call.overload.split(".")[1]
    out = {}
    if call.overload in POSITIVE_ARG:
        out[POSITIVE_ARG[call.overload]] = _POS
    elif UNARY.get(op) is not None:
        out[0] = UNARY[op]
    return {p: c for p, c in out.items()
            if isinstance(call.args[p], TensorMeta) and call.args[p].dtype.is_floating_point}


def pointwise(call: OpCall, kwargs: dict | None = None):
    """``a b c, c, ? -> a b c``: tensors broadcast against the output, the rest ``?``."""
    if not usable(call) or len(call.outputs) != 1 or not isinstance(call.outputs[0], TensorMeta):
        return None
    tensors = [p for p, a in enumerate(call.args) if isinstance(a, TensorMeta)]
    if not tensors:
        return None
    dims = broadcast(Names(), [call.args[p].shape for p in tensors], call.outputs[0].shape)
    if dims is None:
        return None
    per, out = dims
    return build(call, FAMILY, dict(zip(tensors, per)), [out], kwargs=kwargs, inputs=_constraints(call))


@annotation_rule(*UNARY_OVERLOADS, *BINARY_OVERLOADS)
def pointwise_rule(call: OpCall):
    """Any element-wise op (``aten.to``'s ``device`` keyword dropped)."""
    kwargs = {k: v for k, v in call.kwargs.items() if k != "device"}
    spec = pointwise(call, kwargs)
    if spec is not None and call.overload.startswith(("aten.floor_divide", "aten.detach")):
        spec = replace(spec, differentiable=False)  # no derivative in torch; detach's output carries none
    return spec


def to_device(x, device, dtype, non_blocking=False, copy=False, memory_format=None):
    """``aten.to.device`` with the device left to the runtime: a cast to ``dtype``."""
    return torch.ops.aten.to.dtype(x, dtype, non_blocking, copy, memory_format)


@annotation_rule("aten.to.device")
def to_device_rule(call: OpCall):
    """``a b, ?, ? -> a b``, run as :func:`to_device` (the device argument ignored)."""
    spec = pointwise(call)
    return spec and replace(spec, fn=to_device)


@annotation_rule("aten.dropout.default")
def dropout_rule(call: OpCall):
    """``a b, ?, ? -> a b``; where it draws (``p > 0`` in training) each rank runs
    :func:`opzoo.kernels.dropout`, which draws the whole tensor's mask and keeps its slice,
    so a split draws the mask one device draws."""
    spec = pointwise(call)
    args = list(call.args) + [None] * (3 - len(call.args))
    p = call.kwargs.get("p", args[1] if args[1] is not None else 0.5)
    train = call.kwargs.get("train", args[2] if args[2] is not None else True)
    if spec is None or p == 0 or not train:
        return spec
    return replace(spec, local=partial(K.dropout, dims=tuple(spec.annotation.split("->")[1].split())))


DRAWS = ("aten.rand_like.default", "aten.randn_like.default", "aten.uniform.default", "aten.exponential.default",
         "aten.normal_functional.default", "aten.bernoulli.p")


@annotation_rule(*DRAWS)
def draw_rule(call: OpCall):
    """``a b, ? -> a b``: a tensor of random numbers shaped like its input (``rand_like``, and the
    functional forms of ``uniform_``, ``exponential_``, ``normal_``, ``bernoulli_(p)``: a router's
    jitter, Gumbel noise). Each rank runs :func:`opzoo.kernels.draw`: the whole tensor drawn from
    the same generator state, its slice kept, so a split draws the numbers one device draws."""
    spec = pointwise(call)
    if spec is None or call.tensor(0).shape != call.outputs[0].shape:
        return None
    fn = aten_overload(call.overload)
    return replace(spec, differentiable=False,
                   local=partial(K.draw, fn=fn, dims=tuple(spec.annotation.split("->")[1].split())))


@annotation_rule(*INPLACE_OVERLOADS)
def inplace_rule(call: OpCall):
    """``x.div_(y)`` as ``x.div(y)``: ``a b, b -> a b`` (the output must have ``x``'s shape)."""
    spec = pointwise(call)
    if spec is None or call.tensor(0).shape != call.outputs[0].shape:
        return None
    return replace(spec, fn=aten_overload(call.overload.replace("_.", ".", 1)))


@annotation_rule("aten.broadcast_tensors.default")
def broadcast_tensors_rule(call: OpCall):
    """``a 1, b -> a b, a b``: each input aligned against the common shape, flattened in place."""
    if not usable(call) or not call.args[0]:
        return None
    shapes = [m.shape for m in call.args[0]]
    dims = broadcast(Names(), shapes, call.outputs[0].shape)
    if dims is None:
        return None
    per, out = dims
    return build(call, FAMILY, {0: per}, [out] * len(shapes))
