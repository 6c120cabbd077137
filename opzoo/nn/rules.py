"""Rules for layers: normalisation, embedding, attention, as :mod:`opzoo.normalization.entries` and
:mod:`opzoo.nn.entries` split them, for any batch rank.

* ``layer_norm``/``rms_norm``: the normalised trailing dims are frozen (``Size`` of them is the
  ``normalized_shape``), leading dims spatial; an absent weight or bias is a ``?`` None;
* ``embedding``: the vocabulary is split by value with a masked local lookup (a padding index is
  moved into the rank's range, or dropped where the rank does not hold it), the hidden dim and the
  index dims are spatial;
* ``scaled_dot_product_attention``: batch, heads and the value dim are spatial, the head dim and
  the key length frozen; the query length is spatial unless ``is_causal``; a mask is aligned
  from the right against ``(.., s, t)``; with ``enable_gqa`` the query heads are ``(h g)`` over the
  key heads ``h``. Calls with ``dropout_p > 0`` are not annotated.
"""
from __future__ import annotations

from functools import partial

import torch

from nnscaler.ops import Index, Mask, OpCall, TensorMeta, annotation_rule

from .. import kernels as K
from ..rulekit import Names, arg, build, mark, size_arg, usable

FAMILY = "nn"


@annotation_rule("aten.layer_norm.default", "aten.rms_norm.default")
def norm_rule(call: OpCall):
    """``a b h^, ?, h^, h^, ?, ? -> a b h^`` with ``normalized_shape`` ``(Size("h"),)``."""
    if not usable(call):
        return None
    x, shape = call.tensor(0), list(call.args[1])
    k = len(shape)
    if k > x.ndim or tuple(x.shape[x.ndim - k:]) != tuple(shape):
        return None
    names = Names()
    din = [names.dim(n) for n in x.shape]
    for d in range(x.ndim - k, x.ndim):
        din[d] = mark(din[d], "^")
    norm = din[x.ndim - k:]
    ins = {0: din}
    for p in range(2, min(len(call.args), 4 if call.overload == "aten.layer_norm.default" else 3)):
        if isinstance(call.args[p], TensorMeta):
            if tuple(call.args[p].shape) != tuple(shape):
                return None
            ins[p] = norm
    return build(call, FAMILY, ins, [din], args={1: size_arg([d.rstrip("^") for d in norm])})


def embedding_local(shard, weight, index, padding_idx=-1, scale_grad_by_freq=False, sparse=False, *,
                    ident="v"):
    """Vocabulary-parallel ``aten.embedding`` with its positional extras: as
    :func:`opzoo.kernels.embedding`, the padding row moved to local numbering."""
    li, inside = K.lookup(shard, ident, index, weight.shape[0])
    pad = -1
    if padding_idx is not None and padding_idx >= 0:
        local = padding_idx - shard.offset(ident)
        pad = local if 0 <= local < weight.shape[0] else -1
    out = torch.ops.aten.embedding.default(weight, li, pad, scale_grad_by_freq, sparse)
    return out.masked_fill(~inside.unsqueeze(-1), 0)


@annotation_rule("aten.embedding.default")
def embedding_rule(call: OpCall):
    """``v+ h, a b, ? -> a b h``: vocabulary split by value (masked local lookup)."""
    if not usable(call):
        return None
    w, idx = call.tensor(0), call.tensor(1)
    if w.ndim != 2 or any(call.args[3:]) or call.kwargs.get("scale_grad_by_freq") or call.kwargs.get("sparse"):
        return None
    names = Names()
    v, h = names.dim(w.shape[0], "v"), names.dim(w.shape[1], "h")
    di = [names.dim(n) for n in idx.shape]
    local = partial(embedding_local, ident=v) if v != "1" else None
    return build(call, FAMILY, {0: [mark(v, "+"), h], 1: di}, [di + [h]], local=local,
                 inputs={1: Index(w.shape[0] if v == "1" else v, str(idx.dtype).removeprefix("torch."))})


@annotation_rule("aten.scaled_dot_product_attention.default")
def sdpa_rule(call: OpCall):
    """``b h s d^, b h t^ d^, b h t^ e, ?, ?, ? -> b h s e`` (``s^`` when causal; a mask
    ``b 1 s t^`` etc. in place of the first ``?``)."""
    if not usable(call):
        return None
    q, k, v = call.tensor(0), call.tensor(1), call.tensor(2)
    mask = arg(call, 3, "attn_mask", None)
    causal, gqa = arg(call, 5, "is_causal", False), call.kwargs.get("enable_gqa", False)
    if arg(call, 4, "dropout_p", 0.0) or (causal and mask is not None) or not (q.ndim == k.ndim == v.ndim >= 2):
        return None
    lead_q, lead_k = q.shape[:-2], k.shape[:-2]
    if lead_k != v.shape[:-2] or k.shape[-1] != q.shape[-1] or k.shape[-2] != v.shape[-2]:
        return None
    names = Names()
    lead = [names.dim(n) for n in lead_q]
    lead_kv = list(lead)
    if lead_q != lead_k:  # grouped-query attention: heads (h g) over the key heads h
        if not (gqa and q.ndim >= 3 and lead_q[:-1] == lead_k[:-1] and q.shape[-3] % k.shape[-3] == 0):
            return None
        if k.shape[-3] == 1:
            lead_kv[-1] = "1"  # multi-query: one key head for every query head
        else:
            hk, g = names.new(), names.new()
            lead[-1], lead_kv[-1] = f"({hk} {g})", hk
    s = names.dim(q.shape[-2], "s")
    s = mark(s, "^") if causal else s
    t, d = mark(names.dim(k.shape[-2], "t"), "^"), mark(names.dim(q.shape[-1], "d"), "^")
    e = names.dim(v.shape[-1], "e")
    ins = {0: lead + [s, d], 1: lead_kv + [t, d], 2: lead_kv + [t, e]}
    cons = {}
    if isinstance(mask, TensorMeta):
        full = lead + [s, t]
        if lead_q != lead_k:
            return None
        sizes = list(lead_q) + [q.shape[-2], k.shape[-2]]
        off = len(full) - mask.ndim
        if off < 0 or any(n != sizes[off + i] and n != 1 for i, n in enumerate(mask.shape)):
            return None
        ins[3] = [full[off + i] if n == sizes[off + i] else "1" for i, n in enumerate(mask.shape)]
        cons[3] = Mask(0.9) if mask.dtype == torch.bool else None
    return build(call, FAMILY, ins, [lead + [s, e]], inputs=cons)
