"""Keep attention heads a dimension of their own, so tensor parallelism can split them.

``nn.MultiheadAttention`` (``F.multi_head_attention_forward``) computes q, k and v with one packed
projection and unpacks them through a new leading dim of 3 (``unflatten(-1, (3, e))``, ``unsqueeze``,
``transpose``, ``squeeze``, ``contiguous``, ``select``), then merges the heads into the batch:
``view(s, b*h, d)``, ``transpose(0, 1)``, ``view(b, h, s, d)``. In ``(b h)`` the heads are the inner
factor: a layout splits it only in blocks (:mod:`nnscaler.policies.heads` plans that for ``bmm``
attention), and the packed unpacking before it keeps the heads whole, so every rank would gather q,
k and v whole and run all the heads itself.

Two rewrites give each value the same elements by another route:

* :func:`split_packed`: the unpacking becomes ``split(e, dim=-1)`` of the projection, as a fused qkv
  projection is written by hand (nanoGPT's ``c_attn``); only where every unpacked part feeds a head
  merge that :func:`heads_apart` rewrites (their views need the parts' own strides no more);
* :func:`heads_apart`: ``view(s, b*h, d) -> transpose(0, 1) -> view(b, h, s, d)`` becomes
  ``reshape(s, b, h, d) -> permute(1, 2, 0, 3)``: the heads never merge with the batch.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from .rewrite import RESHAPES, set_meta, shape_of

aten = torch.ops.aten


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is(node, target, *args) -> bool:
    """``node`` calls ``target`` on its first argument with exactly the other arguments ``args``."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target
            and tuple(node.args[1:]) == args and not node.kwargs)


def _merge(node: torch.fx.Node):
    """``(view, transpose, view back, s, b, h, d)`` when ``node`` is ``view(x, [s, b*h, d])`` of an
    ``x`` shaped ``(s, b, h*d)``, read only by ``transpose(0, 1)``, read only by ``view([b, h, s, d])``."""
    if node.op != "call_function" or node.target not in RESHAPES or not isinstance(node.args[0], torch.fx.Node):
        return None
    xs, out = shape_of(node.args[0]), shape_of(node)
    if not xs or not out or len(xs) != 3 or len(out) != 3 or out[0] != xs[0]:
        return None
    s, bh, d = out
    b = xs[1]
    if d <= 0 or xs[2] % d or bh != b * (xs[2] // d):
        return None
    h = xs[2] // d
    t = _only_user(node)
    if t is None or not (_is(t, aten.transpose.int, 0, 1) and t.args[0] is node):
        return None
    back = _only_user(t)
    if back is None or back.op != "call_function" or back.target not in RESHAPES or shape_of(back) != (b, h, s, d):
        return None
    return node, t, back, s, b, h, d


def heads_apart(graph: torch.fx.Graph) -> int:
    """Rewrite every head merge :func:`_merge` finds; returns how many."""
    count = 0
    for node in list(graph.nodes):
        found = _merge(node)
        if not found:
            continue
        view, t, back, s, b, h, d = found
        x = view.args[0]
        with graph.inserting_before(back):
            apart = graph.call_function(aten.reshape.default, (x, [s, b, h, d]))
            set_meta(apart, view, x.meta["val"].reshape(s, b, h, d))
            heads = graph.call_function(aten.permute.default, (apart, [1, 2, 0, 3]))
            set_meta(heads, back, apart.meta["val"].permute(1, 2, 0, 3))
        back.replace_all_uses_with(heads)
        for dead in (back, t, view):
            graph.erase_node(dead)
        count += 1
    return count


def _unpacked(node: torch.fx.Node):
    """``(e, selects by index, the chain)`` when ``node`` is ``unflatten(p, -1, [3, e])`` unpacked by
    ``unsqueeze(0) -> transpose(0, -2) -> squeeze(-2) -> contiguous -> select(0, i)``."""
    if node.op != "call_function" or node.target is not aten.unflatten.int or len(node.args) != 3:
        return None
    dim, sizes = node.args[1], node.args[2]
    ps = shape_of(node.args[0])
    if not ps or dim not in (-1, len(ps) - 1) or list(sizes)[:1] != [3] or len(sizes) != 2 or ps[-1] != 3 * sizes[1]:
        return None
    chain = [node]
    for target, args in ((aten.unsqueeze.default, (0,)), (aten.transpose.int, (0, -2)), (aten.squeeze.dim, (-2,)),
                         (aten.contiguous.default, ())):
        nxt = _only_user(chain[-1])
        if nxt is None or not _is(nxt, target, *args) or nxt.args[0] is not chain[-1]:
            return None
        chain.append(nxt)
    selects = {}
    for user in chain[-1].users:
        if user.op != "call_function" or user.target is not aten.select.int or tuple(user.args[1:2]) != (0,):
            return None
        selects[int(user.args[2])] = user
    if sorted(selects) != [0, 1, 2]:
        return None
    return int(sizes[1]), selects, chain


def split_packed(graph: torch.fx.Graph) -> int:
    """Rewrite every packed unpacking :func:`_unpacked` finds whose three parts each feed only a head
    merge (so :func:`heads_apart` rewrites their views next); returns how many."""
    count = 0
    for node in list(graph.nodes):
        found = _unpacked(node)
        if not found:
            continue
        e, selects, chain = found
        if not all(len(sel.users) == 1 and _merge(next(iter(sel.users))) for sel in selects.values()):
            continue
        packed = node.args[0]
        with graph.inserting_before(node):
            parts = graph.call_function(aten.split.Tensor, (packed, e, -1))
            vals = packed.meta["val"].split(e, -1)
            set_meta(parts, node, list(vals))
        for i, sel in selects.items():
            with graph.inserting_after(parts):
                part = graph.call_function(operator.getitem, (parts, i))
            set_meta(part, sel, vals[i])
            sel.replace_all_uses_with(part)
            graph.erase_node(sel)
        for dead in reversed(chain):
            graph.erase_node(dead)
        count += 1
    return count


def heads_outer(graph: torch.fx.Graph) -> int:
    """Both rewrites, packed unpackings first; returns how many rewrites were made."""
    return split_packed(graph) + heads_apart(graph)
