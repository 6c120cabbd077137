"""Reductions over a dim. The reduced dim is split by value (``+``): ``sum`` is linear, so the
plain op on the shards gives partial sums; ``mean``, ``amax``/``amin``, ``logsumexp``, ``norm``,
``var`` and ``std`` run a partition-aware kernel (:mod:`opzoo.kernels`) that reduces
across the split. ``prod``, ``argmax`` and ``max`` (values, indices) keep the reduced dim frozen."""
from __future__ import annotations

from functools import partial

import torch

from nnscaler import register_op

from .. import kernels as K

FAMILY = "reduction"


def _reg(name, annotation, fn, aten, **options):
    register_op(annotation, name, family=FAMILY, aten=aten, **options)(fn)


# --- sum and mean -------------------------------------------------------------------------------
_reg("sum", "* n+ -> *", torch.sum, "aten.sum.dim_IntList", kwargs={"dim": -1})
_reg("sum_keepdim", "* n+ -> * 1", torch.sum, "aten.sum.dim_IntList", kwargs={"dim": -1, "keepdim": True})
_reg("sum_dim0", "n+ * -> *", torch.sum, "aten.sum.dim_IntList", kwargs={"dim": 0})
_reg("sum_all", "a+ b+ -> 1", torch.sum, "aten.sum.default")

_MEAN_N, _MEAN_AB = partial(K.mean, idents=("n",)), partial(K.mean, idents=("a", "b"))
_reg("mean", "* n+ -> *", torch.mean, "aten.mean.dim", kwargs={"dim": -1}, local=_MEAN_N)
_reg("mean_keepdim", "* n+ -> * 1", torch.mean, "aten.mean.dim", kwargs={"dim": -1, "keepdim": True},
     local=_MEAN_N)
_reg("mean_all", "a+ b+ -> 1", torch.mean, "aten.mean.default", local=_MEAN_AB)

# --- non-linear reductions with a cross-rank kernel ---------------------------------------------
KERNELS = {  # name: (fn, aten overloads, kernel)
    "amax": (torch.amax, "aten.amax.default", K.amax),
    "amin": (torch.amin, "aten.amin.default", K.amin),
    "logsumexp": (torch.logsumexp, "aten.logsumexp.default", K.logsumexp),
    "norm": (torch.linalg.vector_norm, "aten.linalg_vector_norm.default", K.vector_norm),
    "var": (torch.var, ("aten.var.dim", "aten.var.correction"), K.var),
    "std": (torch.std, ("aten.std.dim", "aten.std.correction"), K.std),
}
for _name, (_fn, _aten, _kernel) in KERNELS.items():
    _reg(_name, "* n+ -> *", _fn, _aten, kwargs={"dim": -1}, local=partial(_kernel, ident="n"))
_reg("amax_keepdim", "* n+ -> * 1", torch.amax, "aten.amax.default", kwargs={"dim": -1, "keepdim": True},
     local=partial(K.amax, ident="n"))
_reg("var_correction0", "* n+ -> *", torch.var, ("aten.var.correction",),
     kwargs={"dim": -1, "correction": 0}, local=partial(K.var, ident="n"))

# --- frozen reduced dim ---------------------------------------------------------------------------
_reg("prod", "* n^ -> *", torch.prod, "aten.prod.dim_int", kwargs={"dim": -1})
_reg("argmax", "* n^ -> *", torch.argmax, "aten.argmax.default", kwargs={"dim": -1}, differentiable=False)
_reg("max_dim", "* n^ -> *, *", torch.max, "aten.max.dim", kwargs={"dim": -1})
