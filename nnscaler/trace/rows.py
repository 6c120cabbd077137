"""Keep the batch the outer factor of merged rows, so a batch split survives the merge.

``nn.MultiheadAttention`` works on ``(seq, batch, ...)`` tensors: its attention output, ``(batch,
heads, seq, d)``, is permuted to ``(seq, batch, heads, d)``, merged into rows ``(seq*batch, e)`` for
the output projection, and split back into ``(seq, batch, e)``. In the merged dim the batch is the
second factor, which a layout splits only in blocks (``seq`` blocks, each rank its share of the
batch in each), which every reader of the rows (a partition-aware kernel cannot) must follow. The
rows are only used row by row in between (a linear, a dropout), so their order is free: :func:`batch_major_rows` merges them in the permute's input order
instead (``(batch*seq, e)``: a transpose before the merge) and restores the ``(seq, batch, e)``
layout after the split back (a transpose after it). Each row's values are the same; only where the
two merged dims were swapped by the permute (or transpose) just before is the graph rewritten, so a
merge already in its input's order is never made worse.
"""
from __future__ import annotations

import math

import torch
import torch.fx

from .rewrite import RESHAPES, set_meta, shape_of

aten = torch.ops.aten
ROW_WISE = (aten.linear.default, aten.dropout.default)  # act on each row alone (first argument)
PERMUTES = (aten.permute.default, aten.transpose.int)


def _swapped(node: torch.fx.Node) -> bool:
    """``node`` permutes its input so that its dims 0 and 1 come in the reverse of their input order."""
    if node.op != "call_function" or node.target not in PERMUTES or not shape_of(node):
        return False
    ndim = len(shape_of(node))
    if node.target is aten.permute.default:
        perm = [d % ndim for d in node.args[1]]
    else:
        perm = list(range(ndim))
        a, b = node.args[1] % ndim, node.args[2] % ndim
        perm[a], perm[b] = perm[b], perm[a]
    return perm[1] < perm[0]


def _pattern(node: torch.fx.Node):
    """(s, b, the row-wise chain's last node, the split back) when ``node`` merges the swapped dims
    (s, b) of a permute into rows that reach a split back into ``(s, b, e)`` through row-wise ops."""
    if node.op != "call_function" or node.target not in RESHAPES or not isinstance(node.args[0], torch.fx.Node):
        return None
    xs, out = shape_of(node.args[0]), shape_of(node)
    if not xs or not out or len(xs) < 3 or len(out) != 2 or not _swapped(node.args[0]):
        return None
    s, b = xs[0], xs[1]
    if s < 2 or b < 2 or out != (s * b, math.prod(xs[2:])):
        return None
    last = node
    while len(last.users) == 1:
        user = next(iter(last.users))
        if user.op == "call_function" and user.target in ROW_WISE and user.args[0] is last:
            last = user
            continue
        shape = shape_of(user)
        if user.op == "call_function" and user.target in RESHAPES and user.args[0] is last and shape \
                and len(shape) == 3 and shape[:2] == (s, b) and last is not node:
            return s, b, last, user
        return None
    return None


def batch_major_rows(graph: torch.fx.Graph) -> int:
    """Rewrite every merge of rows found by :func:`_pattern` in place; returns how many."""
    count = 0
    for node in list(graph.nodes):
        found = _pattern(node)
        if not found:
            continue
        s, b, last, back = found
        x = node.args[0]
        with graph.inserting_before(node):
            swap = graph.call_function(aten.transpose.int, (x, 0, 1))
        set_meta(swap, node, x.meta["val"].transpose(0, 1))
        node.args = (swap, *node.args[1:])
        e = shape_of(back)[2]
        back.args = (back.args[0], [b, s, e])
        old = back.meta["val"]
        back.meta["val"] = old.transpose(0, 1).contiguous()  # now (b, s, e)
        with graph.inserting_after(back):
            restore = graph.call_function(aten.transpose.int, (back, 0, 1))
        set_meta(restore, back, old)
        back.replace_all_uses_with(restore, delete_user_cb=lambda user: user is not restore)
        count += 1
    return count
