"""Segments of sizes computed from data, traced fixed-shape: ``x.split(counts.tolist())``, a row-wise
map per segment, ``torch.cat`` (a mixture of experts' dispatch: JetMoE's ``JetMoeParallelExperts``).

Traced as written, each segment's size is the sample's, and a guard pins it: every other input
(another rank's shard of the batch, the next step's routing) breaks it. The segments tile ``x``'s
rows and each map acts on rows alone, so row ``r`` of the result is the map of ``r``'s own segment
applied to row ``r``. Under :func:`fixed_segments` (a torch function mode the export runs in), a
``split`` by the list a ``tolist()`` made hands each segment all of ``x``, every segment's map runs on
all rows, and the ``cat`` picks, row by row, the one of the row's segment (``seg = #(ends <= r)``,
``ends`` the running sum of the counts, a tensor of the program): static shapes, nothing pinned.
A segment that meets anything but a row-wise map (``ROW_WISE``) or that ``cat`` raises
:class:`NotSegments`, and the export runs again as written.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

ROW_WISE = {F.linear, F.silu, F.gelu, F.relu, torch.sigmoid, torch.tanh, torch.Tensor.sigmoid,
            torch.Tensor.tanh, torch.Tensor.contiguous}  # row r of the result reads row r of the first argument only
SPLITS = {torch.Tensor.split, torch.split, torch.Tensor.split_with_sizes}


class NotSegments(Exception):
    """A split segment met an operator that is not row-wise: the export runs again as written."""


class _Mode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.lists: dict[int, tuple[list, torch.Tensor]] = {}  # id(a tolist() result) -> (it, its tensor)
        self.tags: dict[int, tuple[Any, int, torch.Tensor]] = {}  # id(segment value) -> (group, index, it)
        self.used = 0

    def remember(self, t: torch.Tensor, out: Any) -> Any:
        """``out = t.tolist()``, its list remembered (``tolist`` reaches no torch function mode)."""
        if isinstance(out, list) and t.dim() == 1 and not t.is_floating_point() and not t.is_complex():
            self.lists[id(out)] = (out, t)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tagged = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) in self.tags]
        if func in SPLITS and not tagged:
            sizes = args[1] if len(args) > 1 else kwargs.get("split_size", kwargs.get("split_sizes"))
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            x = args[0]
            known = self.lists.get(id(sizes))
            if known is not None and known[0] is sizes and dim in (0, -x.dim()) and x.dim() >= 2:
                group = (known[1], x.shape[0], object())
                pieces = []
                for k in range(len(sizes)):
                    p = x.view(x.shape)  # all rows: every segment's map runs on all of x
                    self.tags[id(p)] = (group, k, p)
                    pieces.append(p)
                self.used += 1
                return tuple(pieces)
        if not tagged:
            return func(*args, **kwargs)
        if func in ROW_WISE and args and id(args[0]) in self.tags and len(tagged) == 1:
            group, k, _ = self.tags[id(args[0])]
            out = func(*args, **kwargs)
            self.tags[id(out)] = (group, k, out)
            return out
        if func is torch.cat:
            parts = args[0] if args else kwargs.get("tensors")
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            found = [self.tags.get(id(p)) for p in parts]
            if dim == 0 and all(found) and len({id(f[0]) for f in found}) == 1 \
                    and [f[1] for f in found] == list(range(len(parts))) and len(found[0][0][0]) == len(parts):
                return _pick(found[0][0][0], found[0][0][1], list(parts))
        raise NotSegments(f"{getattr(func, '__name__', func)} on a segment of a split by data-made sizes")


def _pick(counts: torch.Tensor, rows: int, outs: list[torch.Tensor]) -> torch.Tensor:
    """Row ``r`` of the segment ``r`` lies in (counts: the segments' sizes) out of ``outs``."""
    ends = counts.cumsum(0)
    seg = (torch.arange(rows, device=counts.device)[:, None] >= ends[None, :]).sum(1)
    acc = outs[0]
    for k in range(1, len(outs)):
        acc = torch.where((seg == k).view(rows, *[1] * (acc.dim() - 1)), outs[k], acc)
    return acc


@contextlib.contextmanager
def fixed_segments() -> Iterator[_Mode]:
    """Within: splits by data-made sizes traced fixed-shape (see the module); yields the mode (its
    ``used``: how many splits it rewrote)."""
    mode = _Mode()
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    with contextlib.ExitStack() as stack:
        for cls in (torch.Tensor, FakeTensor, FunctionalTensor):  # (the tensor classes export hands the model)
            own = cls.__dict__.get("tolist")
            if own is not None:
                stack.enter_context(mock.patch.object(cls, "tolist", lambda t, own=own: mode.remember(t, own(t))))
        stack.enter_context(mode)
        yield mode
