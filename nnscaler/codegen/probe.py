"""What the instrumented program tells its probe (the mode that localises a divergence).

``generate(..., probe=True)`` emits a program whose ``forward`` takes ``probe``, an object with three
methods, each returning the value the program goes on with:

* ``probe(op, tensor, value, layout)``: an operator's output, in its layout;
* ``probe.conversion(chain, tensor, value, layout, grad_layout, info)``: a tensor as it enters one
  chain of conversion steps (``info``: the layouts from and to, the consumer's split per mesh axis and
  the steps); the alias it returns carries the gradient that comes back through this chain only;
* ``probe.use(op, k, tensor, value, layout, grad_layout, chain)``: the ``k``-th tensor an operator (or
  ``"output"``, the program's return) reads, after its conversion ``chain``, in the layout it reads it;
  the alias carries the gradient of that one use.

Layouts are ``layout_str`` text. A gradient layout says how the pieces of a gradient make the whole:
``D`` split as the tensor, ``R`` whole on every rank, ``V`` a partial sum over the axis (a tensor
read whole by work split along an axis gets a partial gradient there until a conversion sums it).
"""
from __future__ import annotations

from typing import Sequence

from ..comm.conversion import Step
from ..dimops.layout import Layout, Partial, Replicate, Shard, layout_str


def use_grad_layout(layout: Layout, axis_ids: Sequence[str | None], mesh_shape: Sequence[int]) -> str:
    """How the gradient of a consumer's input comes back from the consumer: split as the input, whole
    where the input is a partial value, partial where the input is whole but the work is split."""
    out = []
    for q, ident, f in zip(layout, axis_ids, mesh_shape):
        if isinstance(q, Shard) and f > 1:
            out.append(q)
        elif isinstance(q, Replicate) and ident is not None and f > 1:
            out.append(Partial())
        else:
            out.append(Replicate())
    return layout_str(tuple(out))


def held_grad_layout(layout: Layout, mesh_shape: Sequence[int], sync_axis: int | None = None) -> str:
    """How the gradient of a tensor held in ``layout`` is held once every conversion has run backward:
    split as the tensor, else whole, except on ``sync_axis`` (a parameter whose partial gradient is
    summed in buckets after backward)."""
    out = []
    for a, (q, f) in enumerate(zip(layout, mesh_shape)):
        if f > 1 and a == sync_axis:
            out.append(Partial())
        elif isinstance(q, Shard) and f > 1:
            out.append(q)
        else:
            out.append(Replicate())
    return layout_str(tuple(out))


def steps_text(steps: Sequence[Step]) -> str:
    """``all_gather(axis 0, dims 1) -> grad_all_reduce(axis 0)``, or ``none``."""
    parts = []
    for st in steps:
        dims = f", dims {','.join(map(str, st.dims))}" if st.dims else ""
        blocks = (f", blocks {st.blocks}" if st.blocks > 1 else "") + (", balanced" if st.balanced else "")
        parts.append(f"{st.kind}(axis {st.axis}{dims}{blocks})")
    return " -> ".join(parts) or "none"


def conversion_info(src: Layout, dst: Layout, axis_ids: Sequence[str | None], steps: Sequence[Step],
                    sync_axis: int | None = None) -> dict[str, str]:
    """What ``probe.conversion`` is told about a chain: layouts from and to, the consumer's split
    identifier per mesh axis (``-`` none) and the steps."""
    info = {"from": layout_str(src), "to": layout_str(dst),
            "split": ",".join(i if i is not None else "-" for i in axis_ids), "steps": steps_text(steps)}
    if sync_axis is not None:
        info["synced"] = f"gradient summed over axis {sync_axis} after backward"
    return info
