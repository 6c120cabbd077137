"""Sample inputs from an annotation alone: lengths chosen so every tested split divides evenly,
values non-constant, sign-varying and seeded (reproducible from the printed seed)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nnscaler.dimops.binding import BoundAnno, bind
from nnscaler.dimops.grammar import FROZEN
from nnscaler.ir.graph import IROp, IRTensor
from nnscaler.ops.spec import Complex, Index, Mask, OpSpec, Positive, Uniform, outputs_of, resolve, size_names

from verify.names import DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
SPLIT_MULTIPLES = (2, 1, 3)  # splittable lengths are base x these, cycling over identifiers
FROZEN_LENGTHS = (3, 5, 6, 7)  # lengths of identifiers that are never split
HIDDEN_LENGTHS = (2, 3)  # lengths of non-first factors of a group


def sample_lengths(spec: OpSpec, base: int) -> dict[str, int]:
    """A length for every identifier of the inputs and of ``Size`` arguments (a creator's sizes);
    other output-only ones only where ``spec.sizes`` gives them."""
    anno = spec.anno
    markers = dict(anno.markers())
    hidden = {i.name for t in anno.inputs + anno.outputs for d in t.dims for i in d.idents[1:]}
    in_inputs = {i.name for t in anno.inputs for d in t.dims for i in d.idents}
    in_inputs |= size_names(dict(spec.args)) | size_names(dict(spec.kwargs))
    sizes: dict[str, int] = {}
    n_split = n_frozen = n_hidden = 0
    names = list(markers)
    if any(t.has_star for t in anno.inputs):
        names = [f"*{k}" for k in range(spec.star)] + names
        markers.update({f"*{k}": anno.star_marker() for k in range(spec.star)})
    for name in names:
        if name in spec.sizes:
            sizes[name] = spec.sizes[name]
        elif not name.startswith("*") and name not in in_inputs:
            continue  # output-only: bound from the op's result
        elif name in hidden:
            sizes[name] = HIDDEN_LENGTHS[n_hidden % len(HIDDEN_LENGTHS)]
            n_hidden += 1
        elif markers.get(name) == FROZEN:
            sizes[name] = FROZEN_LENGTHS[n_frozen % len(FROZEN_LENGTHS)]
            n_frozen += 1
        else:
            sizes[name] = base * SPLIT_MULTIPLES[n_split % len(SPLIT_MULTIPLES)]
            n_split += 1
    for name, n in spec.sizes.items():
        sizes.setdefault(name, n)
    return sizes


def _shape(spec: OpSpec, pos: int, sizes: dict[str, int]) -> tuple[int, ...]:
    shape = []
    for d in spec.anno.inputs[pos].dims:
        if len(d.idents) == 1 and d.idents[0].is_star:
            shape += [sizes[f"*{k}"] for k in range(spec.star)]
            continue
        n = 1
        for i in d.idents:
            n *= int(i.name) if i.is_number else sizes[i.name]
        shape.append(n)
    return tuple(shape)


COMPLEX = {torch.float64: torch.complex128, torch.float16: torch.complex32}  # others: complex64


def _values(constraint: Any, shape: tuple[int, ...], dtype: torch.dtype, sizes: dict[str, int],
            g: torch.Generator) -> torch.Tensor:
    if isinstance(constraint, Index):
        high = sizes[constraint.high] if isinstance(constraint.high, str) else constraint.high
        return torch.randint(0, high, shape, generator=g, dtype=getattr(torch, constraint.dtype))
    if isinstance(constraint, Mask):
        return torch.rand(shape, generator=g, dtype=torch.float64) < constraint.p
    if isinstance(constraint, Complex):
        z = torch.randn((*shape, 2), generator=g, dtype=torch.float64)
        return torch.view_as_complex(z).to(COMPLEX.get(dtype, torch.complex64))
    if isinstance(constraint, (Positive, Uniform)):
        x = constraint.low + (constraint.high - constraint.low) * torch.rand(shape, generator=g, dtype=torch.float64)
    elif constraint is None:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    else:
        raise TypeError(f"unknown input constraint {constraint!r}")
    return x.to(dtype)


def input_values(spec: OpSpec, pos: int, bound: BoundAnno, dtype: torch.dtype, g: torch.Generator) -> Any:
    """Input ``pos`` of ``spec`` at the lengths of ``bound`` (a traced call's): its ``?`` value, or
    seeded values honouring the spec's constraint."""
    if spec.anno.inputs[pos].opaque:
        return resolve(spec.args[pos], bound.sizes)
    return _values(spec.inputs.get(pos), bound.shape(bound.inputs[pos]), dtype, bound.sizes, g)


@dataclass
class Sample:
    """Whole inputs, bound annotation and cotangents for one (op, dtype, seed, base)."""

    spec: OpSpec
    bound: BoundAnno
    inputs: list[Any]
    cotangents: list[torch.Tensor | None]
    dtype: torch.dtype
    seed: int



def make_sample(spec: OpSpec, dtype: torch.dtype, seed: int, base: int) -> Sample:
    """Seeded sample inputs for ``spec``; the op runs once to bind its output-only identifiers."""
    sizes = sample_lengths(spec, base)
    g = torch.Generator().manual_seed(seed)
    inputs: list[Any] = []
    for pos, t in enumerate(spec.anno.inputs):
        if t.opaque:
            inputs.append(resolve(spec.args[pos], sizes))
        else:
            inputs.append(_values(spec.inputs.get(pos), _shape(spec, pos, sizes), dtype, sizes, g))
    in_shapes = [None if t.opaque else tuple(x.shape) for t, x in zip(spec.anno.inputs, inputs)]
    known = {k: v for k, v in sizes.items() if not k.startswith("*")}
    bound = bind(spec.anno, in_shapes, known=known)
    with torch.no_grad():
        outs = outputs_of(spec.anno, spec.fn(*inputs, **resolve(dict(spec.kwargs), bound.sizes)))
    out_shapes = [None if t.opaque else tuple(y.shape) for t, y in zip(spec.anno.outputs, outs)]
    bound = bind(spec.anno, in_shapes, out_shapes, known=known)
    cots = []
    for y in outs:
        if isinstance(y, torch.Tensor) and y.is_complex() and spec.differentiable:  # a complex cotangent
            cots.append(torch.randn(y.shape, generator=g, dtype=torch.complex128).to(y.dtype))
        elif isinstance(y, torch.Tensor) and y.is_floating_point() and spec.differentiable:
            cots.append(torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype))
        else:
            cots.append(None)
    return Sample(spec, bound, inputs, cots, dtype, seed)


def op_sample(op: IROp, bound: BoundAnno, seed: int) -> tuple[Sample, tuple]:
    """Inputs at ``bound``'s lengths in the op's traced dtypes (constraints of the spec honoured),
    and the op's outputs on them."""
    spec = op.spec
    inputs = []
    g = torch.Generator().manual_seed(seed)
    for pos, t in enumerate(spec.anno.inputs):
        x = op.inputs[pos] if pos < len(op.inputs) else None
        dtype = x.dtype if isinstance(x, IRTensor) else torch.float32
        inputs.append(input_values(spec, pos, bound, dtype, g))
    with torch.no_grad():
        outs = outputs_of(spec.anno, spec.fn(*inputs, **resolve(dict(spec.kwargs), bound.sizes)))
    cots = [torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
            if isinstance(y, torch.Tensor) and y.is_floating_point() and spec.differentiable else None for y in outs]
    dtype = next((x.dtype for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()), torch.float32)
    return Sample(spec, bound, inputs, cots, dtype, seed), outs
