"""Rules for mixture-of-experts bookkeeping and the grouped matmul.

* ``histc``: a count over all elements, split by value (``n+ -> b^``): partial histograms sum;
* grouped matmul (``aten._grouped_mm`` and transformers' ``grouped_mm_fallback`` custom op, which
  ``torch.export`` records for transformers' default ``grouped_mm`` experts):
  ``s^ k+, e^ k+ n, e^ -> s^ n``: the rows are grouped by the offsets (frozen), the expert dim
  frozen, the contraction split by value and the output columns spatially. Both run as
  :func:`grouped_mm`, plain matmuls per group, which (unlike ``torch._grouped_mm``) also has float64
  and any alignment, so the harness's float64 reference can run it.
"""
from __future__ import annotations

import torch

from nnscaler.ops import Index, OpCall, annotation_rule
from nnscaler.ops.registry import DEFAULT_REGISTRY

from ..rulekit import Names, build, mark, usable

FAMILY = "moe"
TRANSFORMERS_GROUPED_MM = "transformers.grouped_mm_fallback.default"


@annotation_rule("aten.histc.default")
def histc_rule(call: OpCall):
    """``a+ b+, ?, ?, ? -> c^``: per-rank histograms of its elements are partial counts."""
    if not usable(call):
        return None
    x, out = call.tensor(0), call.outputs[0]
    names = Names()
    din = [mark(names.dim(n), "+") for n in x.shape]
    bins = names.dim(out.shape[0])
    sizes = {} if bins == "1" else {bins: out.shape[0]}
    return build(call, FAMILY, {0: din}, [[bins + "^" if bins != "1" else bins]], sizes=sizes, differentiable=False)


def grouped_mm(x, w, offs):
    """``out[start:end] = x[start:end] @ w[i]`` for each group ``i`` ending at ``offs[i]``; rows past
    the last offset are zero (as in transformers' fallback)."""
    out = x.new_zeros(x.shape[0], w.shape[-1])
    pieces, start = [], 0
    for i, end in enumerate(offs.tolist()):
        end = max(start, min(int(end), x.shape[0]))
        if end > start:
            pieces.append((start, end, x[start:end] @ w[i]))
        start = end
    if not pieces:
        return out
    rows = [p for _, _, p in pieces]
    tail = out[pieces[-1][1]:]
    head = out[:pieces[0][0]]
    return torch.cat([head, *rows, tail], 0)


def grouped_mm_rule(call: OpCall):
    """``s^ k+, e^ k+ n, e^ -> s^ n``."""
    if not usable(call) or len(call.args) < 3 or call.kwargs.get("bias") is not None:
        return None
    x, w, offs = call.tensor(0), call.tensor(1), call.tensor(2)
    if x.ndim != 2 or w.ndim != 3 or offs.ndim != 1 or offs.shape[0] != w.shape[0] or w.shape[1] != x.shape[1]:
        return None
    names = Names()
    s, k, e, n = names.new("s"), names.new("k"), names.new("e"), names.new("n")
    return build(call, FAMILY, {0: [s + "^", k + "+"], 1: [e + "^", k + "+", n], 2: [e + "^"]}, [[s + "^", n]],
                 fn=grouped_mm, inputs={2: Index(s, str(offs.dtype).removeprefix("torch."))}, kwargs={})


DEFAULT_REGISTRY.add_rule("aten._grouped_mm.default", grouped_mm_rule)


def register_transformers_grouped_mm() -> bool:
    """Annotate transformers' ``grouped_mm_fallback`` custom op where transformers has defined it
    (importing transformers is slow, so the zoo does not do it); True if registered."""
    try:
        DEFAULT_REGISTRY.add_rule(TRANSFORMERS_GROUPED_MM, grouped_mm_rule)
    except KeyError:
        return False
    return True


register_transformers_grouped_mm()
