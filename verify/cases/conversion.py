"""One rank's part of a layout-conversion case: run the steps :func:`nnscaler.comm.conversion.conversion`
chooses, through the very expressions generated programs use (``Step.code``), and compare the local
result and the gradient that comes back with the right pieces of the whole tensor and cotangent.

Values are small integers held in float64 (or int64 for a tensor without gradient), so every sum is
exact and pieces compare with ``torch.equal``: a wrong piece, a wrong order or a missing sum is a
mismatch, never rounding.

A job is a dict: ``kind="conversion"``, ``mesh`` (shape), ``shape`` (the tensor's), ``src`` and ``dst``
(layout text such as ``"D0xV"``), ``ids`` (the consumer's identifier per axis or ``None``: an ``R``
axis with an identifier is ``R*``, whose incoming gradient is partial), ``grad`` (float with
gradient, or integer forward-only) and ``seed``.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch
import torch.distributed as dist

from nnscaler.codegen.emit import shard_slices
from nnscaler.comm.conversion import conversion
from nnscaler.dimops.layout import Layout, Partial, Replicate, Shard, layout_str, shard_indices, take_piece
from nnscaler.dimops.partition import coords
from nnscaler.runtime import collectives as C
from nnscaler.runtime.mesh import GroupCache, RankMesh


def parse_layout(text: str) -> Layout:
    """Inverse of :func:`layout_str`: ``"D0xRxV"`` -> ``(Shard(0), Replicate(), Partial())``."""
    out = []
    for q in text.split("x"):
        if q == "R":
            out.append(Replicate())
        elif q == "V":
            out.append(Partial())
        elif q.startswith("D") and q[1:].removesuffix("z").replace("/", "", 1).isdigit() and not q.endswith("/"):
            out.append(Shard.parse(q))
        else:
            raise ValueError(f"layout {text!r}: each axis is R, V, D<dim>, D<dim>/<blocks> or either with a "
                             f"trailing z (balanced), separated by 'x'")
    return tuple(out)


def _whole(shape: Sequence[int], seed: int, salt: int, floating: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + salt)
    x = torch.randint(-8, 9, tuple(shape), generator=g)
    return x.double() if floating else x


def _partial_piece(whole: torch.Tensor, coords: Sequence[int], axes: Sequence[int], mesh: Sequence[int],
                   seed: int, salt: int) -> torch.Tensor:
    """This rank's addend when ``whole`` is a sum over the coordinates of ``axes`` (random integer
    addends, the last one making up the rest), identical on every rank that shares those coordinates."""
    if not axes:
        return whole
    combos = list(itertools.product(*(range(mesh[a]) for a in axes)))
    mine = combos.index(tuple(coords[a] for a in axes))
    g = torch.Generator().manual_seed(seed * 7919 + salt)
    parts = [torch.randint(-8, 9, whole.shape, generator=g).to(whole.dtype) for _ in combos[:-1]]
    parts.append(whole - sum(parts, torch.zeros_like(whole)))
    return parts[mine]


def _piece(whole: torch.Tensor, layout: Layout, mesh: Sequence[int], rank: int) -> torch.Tensor:
    """This rank's piece; a balanced split (its dim's only split) picks its two chunks by index."""
    at = coords(rank, tuple(mesh))
    plain = tuple(Replicate() if isinstance(q, Shard) and q.balanced else q for q in layout)
    x = take_piece(whole, shard_slices(tuple(whole.shape), plain, tuple(mesh), rank))
    for a, q in enumerate(layout):
        if isinstance(q, Shard) and q.balanced and mesh[a] > 1:
            idx = shard_indices(x.shape[q.dim], mesh[a], at[a], q.blocks, True)
            x = x.index_select(q.dim, torch.tensor(idx))
    return x


def _sum_over(x: torch.Tensor, axes: Sequence[int], groups) -> torch.Tensor:
    x = x.detach().clone()
    for a in axes:
        if groups[a] is not None:
            dist.all_reduce(x, group=groups[a])
    return x


def run_conversion(job: dict, rank: int, groups: GroupCache) -> dict:
    """Run one conversion on this rank; the answer lists the steps and any mismatch found."""
    mesh_shape, shape = tuple(job["mesh"]), tuple(job["shape"])
    src, dst = parse_layout(job["src"]), parse_layout(job["dst"])
    ids, grad, seed = tuple(job["ids"]), bool(job["grad"]), int(job["seed"])
    mesh = RankMesh.build(mesh_shape, rank, groups)
    steps, cost = conversion(src, dst, ids, mesh_shape, shape, grad)
    x_whole = _whole(shape, seed, 1, grad)
    src_v = [a for a, q in enumerate(src) if isinstance(q, Partial)]
    x = _partial_piece(_piece(x_whole, src, mesh_shape, rank), mesh.coords, src_v, mesh_shape, seed, 2)
    x = x.clone().requires_grad_(grad)
    env = {"C": C, "g": mesh.groups, "x": x}
    y = x
    for step in steps:  # the expressions the generated program runs
        env["x"] = y
        y = eval(step.code("x", "g[%d]" % step.axis), env)  # noqa: S307 (our own generated text)
    problems = []
    dst_v = [a for a, q in enumerate(dst) if isinstance(q, Partial)]
    want = _piece(x_whole, dst, mesh_shape, rank)
    got = _sum_over(y, dst_v, mesh.groups)
    if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
        problems.append(f"forward: local result {tuple(got.shape)} is not the {layout_str(dst)} piece "
                        f"{tuple(want.shape)} of the whole tensor")
    # every rank runs backward or none does: a rank skipping it alone would leave its peers waiting
    everyone = groups.get(list(range(math.prod(mesh_shape))))
    bad = torch.tensor([float(bool(problems))])
    if everyone is not None:
        dist.all_reduce(bad, group=everyone)
    if grad and not bad.item():
        g_whole = _whole(shape, seed, 3, True)
        star = [a for a, (q, i) in enumerate(zip(dst, ids)) if isinstance(q, Replicate) and i is not None
                and mesh_shape[a] > 1]
        cot = _partial_piece(_piece(g_whole, dst, mesh_shape, rank), mesh.coords, star, mesh_shape, seed, 4)
        y.backward(cot)
        want_g = _piece(g_whole, src, mesh_shape, rank)
        if x.grad is None:
            problems.append("backward: no gradient reached the source")
        elif tuple(x.grad.shape) != tuple(want_g.shape) or not torch.equal(x.grad, want_g):
            problems.append(f"backward: the gradient {tuple(x.grad.shape)} is not the {layout_str(src)} piece "
                            f"{tuple(want_g.shape)} of the whole gradient")
    return {"steps": [f"{s.kind}{list(s.dims)}@{s.axis}" for s in steps], "cost": cost, "problems": problems,
            "ranks": math.prod(mesh_shape)}
