"""Activations (element-wise, every dim spatial) and softmax-like normalisers over one dim, whose
normalised dim is frozen (``^``): each output element depends on the whole row."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nnscaler import register_op

FAMILY = "activation"


def _reg(name, annotation, fn, aten, **options):
    register_op(annotation, name, family=FAMILY, aten=aten, **options)(fn)


ELEMENTWISE = {  # name: (fn, kwargs, aten overload)
    "relu": (torch.relu, {}, "aten.relu.default"),
    "gelu": (F.gelu, {}, "aten.gelu.default"),
    "gelu_tanh": (F.gelu, {"approximate": "tanh"}, "aten.gelu.default"),
    "silu": (F.silu, {}, "aten.silu.default"),
    "sigmoid": (torch.sigmoid, {}, "aten.sigmoid.default"),
    "tanh": (torch.tanh, {}, "aten.tanh.default"),
    "leaky_relu": (F.leaky_relu, {"negative_slope": 0.1}, "aten.leaky_relu.default"),
    "elu": (F.elu, {}, "aten.elu.default"),
    "softplus": (F.softplus, {}, "aten.softplus.default"),
    "mish": (F.mish, {}, "aten.mish.default"),
    "hardtanh": (F.hardtanh, {}, "aten.hardtanh.default"),
    "hardswish": (F.hardswish, {}, "aten.hardswish.default"),
    "hardsigmoid": (F.hardsigmoid, {}, "aten.hardsigmoid.default"),
    "logsigmoid": (F.logsigmoid, {}, "aten.log_sigmoid.default"),
}
for _name, (_fn, _kw, _aten) in ELEMENTWISE.items():
    _reg(_name, "* -> *", _fn, _aten, kwargs=_kw)

# softmax over the last dim, and over dim 1 with trailing dims (e.g. class dim of N C H W)
_reg("softmax", "* n^ -> * n^", torch.softmax, ("aten.softmax.int", "aten._softmax.default"),
     kwargs={"dim": -1})
_reg("log_softmax", "* n^ -> * n^", torch.log_softmax, ("aten.log_softmax.int", "aten._log_softmax.default"),
     kwargs={"dim": -1})
_reg("softmax_dim1", "b n^ * -> b n^ *", torch.softmax, ("aten.softmax.int", "aten._softmax.default"),
     kwargs={"dim": 1})
# glu halves the last dim: out = a * sigmoid(b) with (a, b) = x.chunk(2, -1)
_reg("glu", "* (2 n) -> * n", F.glu, "aten.glu.default", kwargs={"dim": -1})
