"""Rows indexed by their own position: ``x[arange(B)[:, None, ...], j]`` as a per-row lookup.

transformers builds its attention masks from the padding mask ``x`` (``(B, L)``) with advanced
indexing, ``x[batch_arange.view(B, 1, 1, 1), kv_idx.view(1, 1, 1, D)]``. An ``index.Tensor``'s
rule cannot know that an index is ``arange``: the indexed batch dim is frozen (any row may be
read), so under ``dp`` every rank gathers the whole mask, and everything built from it (``&``,
``where``, ``expand``) stays whole. When the first index is a full ``arange`` over ``x``'s first dim
(start 0, step 1, reshaped to ``(B, 1, ..., 1)``) and the second leaves that position at 1, the
result is row ``b`` of ``x`` looked up at ``j`` for every ``b``: :func:`per_row_index` rewrites it to
``x.index_select(1, j.flatten()).view(B, *j.shape[1:])``, whose batch dim is an ordinary
spatial one. Any other index (an offset, a step, a permutation, fewer rows) is left as it was.
"""
from __future__ import annotations

import torch
import torch.fx

from .rewrite import RESHAPES, set_meta, shape_of

aten = torch.ops.aten
SHAPE_ONLY = (aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _is_full_arange(node, n: int) -> bool:
    """``node`` is ``arange(n)`` (start 0, step 1, integer) under unsqueezes and reshapes only."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in SHAPE_ONLY:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target is aten.arange.default:
        return len(node.args) == 1 and node.args[0] == n
    if node.target is aten.arange.start_step:
        return node.args[:3] == (0, n, 1) or (node.args[:2] == (0, n) and len(node.args) == 2)
    if node.target is aten.arange.start:
        return node.args[:2] == (0, n)
    return False


def _pattern(node: torch.fx.Node):
    """(x, j) when ``node`` is ``index.Tensor(x, [arange(B) as (B, 1, ..), j])`` with ``j`` 1 at dim 0."""
    if node.op != "call_function" or node.target is not aten.index.Tensor or len(node.args) != 2:
        return None
    x, idx = node.args
    xs = shape_of(x)
    if xs is None or len(xs) != 2 or not isinstance(idx, (list, tuple)) or len(idx) != 2 or None in idx:
        return None
    i0, j = idx
    s0, sj, out = shape_of(i0), shape_of(j), shape_of(node)
    if not s0 or not sj or out is None or len(s0) != len(sj) or len(out) != len(s0):
        return None
    if s0[0] != xs[0] or any(s != 1 for s in s0[1:]) or sj[0] != 1 or not _is_full_arange(i0, xs[0]):
        return None
    return x, j


def per_row_index(graph: torch.fx.Graph) -> int:
    """Rewrite every such index (see the module); returns how many."""
    n = 0
    for node in list(graph.nodes):
        got = _pattern(node)
        if got is None:
            continue
        x, j = got
        val, jval = node.meta["val"], j.meta["val"]
        with graph.inserting_before(node):
            flat = graph.call_function(aten.reshape.default, (j, [-1]))
            set_meta(flat, node, jval.reshape(-1))
            sel = graph.call_function(aten.index_select.default, (x, 1, flat))
            set_meta(sel, node, x.meta["val"].index_select(1, jval.reshape(-1)))
            out = graph.call_function(aten.reshape.default, (sel, list(val.shape)))
            set_meta(out, node, val)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        n += 1
    return n
