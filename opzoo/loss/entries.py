"""Losses. ``cross_entropy`` and ``nll_loss`` split the class dim by value with a vocabulary-parallel
kernel (max and sum-exp reduced across the class split, the target logit picked where it lives);
rows are spatial for ``reduction='none'`` and split by value when reduced (``sum``: partial sums;
``mean``: local sum over the FULL count of non-ignored targets). Pointwise losses reduced by
``mean`` divide the local sum by the full element count."""
from __future__ import annotations

from functools import partial

import torch.nn.functional as F

from nnscaler import Index, Uniform, register_op

from .. import kernels as K

FAMILY = "loss"


def _reg(name, annotation, fn, aten, **options):
    register_op(annotation, name, family=FAMILY, aten=aten, **options)(fn)


_TARGET = {1: Index("v")}
for _fn, _kernel, _aten, _prefix in ((F.cross_entropy, K.cross_entropy, "aten.cross_entropy_loss.default",
                                      "cross_entropy"),
                                     (F.nll_loss, K.nll_loss, "aten.nll_loss_nd.default", "nll_loss")):
    _local = partial(_kernel, row="n", cls="v")
    _reg(f"{_prefix}_none", "n v+, n -> n", _fn, _aten, kwargs={"reduction": "none"}, inputs=_TARGET,
         local=_local)
    _reg(f"{_prefix}_sum", "n+ v+, n+ -> 1", _fn, _aten, kwargs={"reduction": "sum"}, inputs=_TARGET,
         local=_local)
    _reg(f"{_prefix}_mean", "n+ v+, n+ -> 1", _fn, _aten, kwargs={"reduction": "mean"}, inputs=_TARGET,
         local=_local)

POINTWISE = {  # name: (fn, aten overload, target constraint)
    "mse_loss": (F.mse_loss, "aten.mse_loss.default", None),
    "l1_loss": (F.l1_loss, "aten.l1_loss.default", None),
    "smooth_l1_loss": (F.smooth_l1_loss, "aten.smooth_l1_loss.default", None),
    "huber_loss": (F.huber_loss, "aten.huber_loss.default", None),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, "aten.binary_cross_entropy_with_logits.default",
                        Uniform(0.0, 1.0)),
}
for _name, (_fn, _aten, _c) in POINTWISE.items():
    _inputs = {1: _c} if _c is not None else None
    _reg(_name, "a+ b+, a+ b+ -> 1", _fn, _aten, inputs=_inputs,
         local=partial(K.pointwise_loss_mean, fn=_fn, idents=("a", "b")))
_reg("mse_loss_sum", "a+ b+, a+ b+ -> 1", F.mse_loss, "aten.mse_loss.default", kwargs={"reduction": "sum"})
_reg("mse_loss_none", "*, * -> *", F.mse_loss, "aten.mse_loss.default", kwargs={"reduction": "none"})
