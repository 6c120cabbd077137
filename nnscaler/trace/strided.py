"""``as_strided`` on a view whose storage it covers exactly (a transpose, a permute): read from a
contiguous copy laid out in the storage's order instead, so the result no longer depends on how the
program holds the view.

``x.as_strided(size, stride)`` reads ``x``'s storage, not its values: on a transposed ``x`` (Longformer's
and LED's sliding chunks, ``hidden_states.as_strided(...)`` after ``.transpose(1, 2)``) a parallel program,
which holds ``x`` gathered or split in its own layout, would read other elements (``build.READS_STRIDES``
refuses that). When ``x`` is non-overlapping and dense, its storage is exactly ``x`` permuted so that its
strides decrease, made contiguous: :func:`dense_as_strided` rewrites the read to
``x.permute(perm).contiguous().as_strided(size, stride, offset - x.storage_offset())``, equal on one
device, and layout-free. A view with gaps or overlaps (a slice, an expand) is left as it was (and refused).
"""
from __future__ import annotations

import torch
import torch.fx

from .rewrite import set_meta

aten = torch.ops.aten


def _storage_order(val: torch.Tensor) -> list[int]:
    """The permutation of ``val``'s dims by decreasing stride (size-1 dims last: their stride is free)."""
    return sorted(range(val.dim()), key=lambda d: (val.shape[d] == 1, -val.stride()[d], d))


def _dense(val: torch.Tensor) -> bool:
    """Whether ``val`` covers its storage span exactly once (non-overlapping and dense)."""
    expect = 1
    for d in reversed(_storage_order(val)):
        if val.shape[d] != 1:
            if val.stride()[d] != expect:
                return False
            expect *= val.shape[d]
    return True


def dense_as_strided(graph: torch.fx.Graph) -> int:
    """Rewrite every ``as_strided`` of a non-contiguous, non-overlapping and dense view (see the module);
    returns how many."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.as_strided.default:
            continue
        src = node.args[0]
        val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.is_contiguous() or not _dense(val):
            continue
        perm = _storage_order(val)
        size, stride = node.args[1], node.args[2]
        offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
        with graph.inserting_before(node):
            permuted = graph.call_function(aten.permute.default, (src, perm))
            set_meta(permuted, node, val.permute(perm))
            dense = graph.call_function(aten.clone.default, (permuted,), {"memory_format": torch.contiguous_format})
            set_meta(dense, node, val.permute(perm).contiguous())
            args = (dense, size, stride) if offset is None else (dense, size, stride, offset - val.storage_offset())
            read = graph.call_function(aten.as_strided.default, args)
            set_meta(read, node, node.meta["val"])
        node.replace_all_uses_with(read)
        graph.erase_node(node)
        n += 1
    return n
