"""Neural-network layers: embedding, attention, convolution, dropout.

* ``embedding`` splits the vocabulary by value (Megatron's vocab-parallel embedding: a rank looks
  up only the rows it holds, the others come out zero) and the hidden dim spatially.
* ``scaled_dot_product_attention`` splits batch and heads; the key length and the head dim are
  frozen (softmax and the scale span them); the query length may be split only without a causal
  mask (a causal mask depends on the query position); the value dim ``e`` is spatial.
* convolutions split the batch, the output channels, and the input channels by value (a bias,
  written ``+o``, is then held by one rank); spatial extents are frozen (a split would need halos).
* dropout is only registered where it is the identity (``p=0`` or eval mode): random masks differ
  between a whole tensor and its shards.
* ``ring.scaled_dot_product_attention`` (the operator the ring policies rebind attention to,
  :mod:`nnscaler.policies.ring`): queries, keys and values on one sequence ``s``, split by the ring kernel
  :func:`nnscaler.runtime.ring.ring_attention` (keys and values passed rank to rank); registered causal, with a
  boolean mask (its key columns ``t^`` whole, no gradient) and with keys transposed (eager ``q @ k^T``).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from nnscaler import Index, Mask, register_op

from nnscaler.runtime.ring import attention as _ring_whole, ring_attention as _ring_local

from .. import kernels as K

FAMILY = "nn"


def _reg(name, annotation, fn, aten, **options):
    register_op(annotation, name, family=FAMILY, aten=aten, **options)(fn)


# aten.embedding's argument order: (weight, indices)
_reg("embedding", "v+ h, * -> * h", torch.embedding, "aten.embedding.default", inputs={1: Index("v")},
     local=partial(K.embedding, ident="v"))

_SDPA = "aten.scaled_dot_product_attention.default"
_reg("sdpa", "b h s d^, b h t^ d^, b h t^ e -> b h s e", F.scaled_dot_product_attention, _SDPA)
_reg("sdpa_causal", "b h s^ d^, b h s^ d^, b h s^ e -> b h s^ e", F.scaled_dot_product_attention, _SDPA,
     kwargs={"is_causal": True})
_reg("sdpa_mask", "b h s d^, b h t^ d^, b h t^ e, b h s t^ -> b h s e", F.scaled_dot_product_attention, _SDPA)
_reg("sdpa_mask_bcast", "b h s d^, b h t^ d^, b h t^ e, s t^ -> b h s e", F.scaled_dot_product_attention,
     _SDPA)
_reg("sdpa_scale", "b h s d^, b h t^ d^, b h t^ e -> b h s e", F.scaled_dot_product_attention, _SDPA,
     kwargs={"scale": 0.3})



def _ring(name, annotation, mods, keys_transposed=False, **options):
    kw = {"mods": mods, "keys_transposed": keys_transposed}
    register_op(annotation, name, family=FAMILY, local=partial(_ring_local, ident="s", **kw), exchange=(("s", (1, 2)),),
                doc="ring.scaled_dot_product_attention: attention over a split sequence, keys and values around the "
                    "ring", **options)(partial(_ring_whole, **kw))


# entries of operators the compiler makes itself (the ring policies' rebinding), which no trace yields: no ATen overload
COMPILER_OWN = ("ring_sdpa_causal", "ring_sdpa_keep", "ring_eager_causal")
_ring("ring_sdpa_causal", "b h s d^, b h s d^, b h s e -> b h s e", (("mul", 0.25), ("causal",)))
_ring("ring_sdpa_keep", "b h s d^, b h s d^, b h s e, b 1 s t^ -> b h s e", (("mul", 0.25), ("keep", 0)),
      inputs={3: Mask(0.9)}, sizes={"s": 8, "t": 8})
_ring("ring_eager_causal", "b h s d^, b h d^ s, b h s e -> b h s e", (("div", 2.0), ("causal",)), keys_transposed=True)

_CONV1 = {"l": 9, "k": 3}
_reg("conv1d", "n c+ l^, o c+ k^, +o -> n o m^", F.conv1d, "aten.conv1d.default", sizes=_CONV1)
_reg("conv1d_nobias", "n c+ l^, o c+ k^ -> n o m^", F.conv1d, "aten.conv1d.default", sizes=_CONV1,
     kwargs={"padding": 1})
_CONV2 = {"hi": 7, "wi": 6, "kh": 3, "kw": 2}
_reg("conv2d", "n c+ hi^ wi^, o c+ kh^ kw^, +o -> n o ho^ wo^", F.conv2d, "aten.conv2d.default",
     sizes=_CONV2, kwargs={"padding": 1})
_reg("conv2d_nobias", "n c+ hi^ wi^, o c+ kh^ kw^ -> n o ho^ wo^", F.conv2d, "aten.conv2d.default",
     sizes=_CONV2, kwargs={"stride": 2})

_reg("dropout_p0", "* -> *", F.dropout, "aten.dropout.default", kwargs={"p": 0.0, "training": True})
_reg("dropout_eval", "* -> *", F.dropout, "aten.dropout.default", kwargs={"p": 0.5, "training": False})
