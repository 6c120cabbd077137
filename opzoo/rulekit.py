"""The kit for writing annotation rules and their verified examples, shared by every family's
``rules.py`` and ``examples.py``: fresh identifier names, dim bookkeeping, one builder that turns
per-tensor dims into an :class:`~nnscaler.ops.spec.OpSpec` for one call, and
:func:`register_examples`, which derives each example call's spec with the registered rules and adds
it to the zoo (family ``rules``, name ``rule.<op>.<i>``, e.g. ``rule.view.0``, ``rule.add.Tensor.2``),
so ``python -m verify all`` checks the rules' annotations on real ranks, at the harness's own lengths.

Conventions every rule follows:

* every dim of length 1 is written ``1`` (never split, and it may broadcast);
* a dim is written as a list of *factors*: ``["a"]`` is ``a``, ``["a", "b"]`` is the group ``(a b)``;
* non-tensor arguments are ``?`` with their value (or a ``Size`` expression) in ``args``;
* a positional argument that is a list of tensors (``cat``) is *flattened in place*: each tensor is
  one annotated input, and ``fn`` is a :class:`Regroup` that rebuilds the list before calling the op;
* a rule returns ``None`` when it cannot annotate the call (zero-sized tensors, tensor kwargs, ...).

In examples, ``T(2, 8, 32)`` is a tensor argument by shape (``I``: int64, ``B``: bool); ``ex(*args,
**kwargs)`` one call. An example's outputs are found by running the op on zeros, as a traced graph
would record them.
"""
from __future__ import annotations

import string
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from nnscaler.dimops.binding import bind
from nnscaler.ops import (DEFAULT_REGISTRY, Complex, Index, Mask, OpCall, OpRegistry, OpSpec, Size, TensorMeta,
                          aten_overload)
from nnscaler.trace.calls import flatten_tensor_lists

INT_MAX = 2 ** 63 - 1


class Names:
    """Fresh identifiers: ``a, b, c, ...`` or a hint (``k``, ``v``) while it is still free."""

    def __init__(self) -> None:
        self.used: set[str] = set()
        self._pool = iter([c for c in string.ascii_lowercase] + [f"{c}{i}" for i in range(1, 10)
                                                                 for c in string.ascii_lowercase])

    def new(self, hint: str | None = None) -> str:
        if hint and hint not in self.used:
            self.used.add(hint)
            return hint
        for name in self._pool:
            if name not in self.used:
                self.used.add(name)
                return name
        raise RuntimeError("out of identifier names")

    def dim(self, length: int, hint: str | None = None) -> str:
        """``1`` (or ``0``) for a dim of length 1 (or 0), else a fresh identifier."""
        return str(length) if length in (0, 1) else self.new(hint)


def along(x: TensorMeta, index: TensorMeta, dim: int) -> int | None:
    """The dim ``gather``/``scatter`` index ``x`` along (as a position), where ``index`` has ``x``'s
    rank and its lengths on every other dim (those dims are then shared, spatial); else None."""
    if x.ndim == 0 or index.ndim != x.ndim:
        return None
    d = norm_dim(dim, x.ndim)
    return None if any(index.shape[i] != x.shape[i] for i in range(x.ndim) if i != d) else d


def norm_dim(dim: int, ndim: int) -> int:
    """A possibly negative dim index as a position (a 0-d tensor has one dim position, 0)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"dim {dim} out of range for {ndim} dims")
    return dim % n


def arg(call: OpCall, pos: int, name: str, default: Any = None) -> Any:
    """An argument given by position or by keyword (``default`` when absent or None)."""
    value = call.args[pos] if len(call.args) > pos else call.kwargs.get(name, default)
    return default if value is None else value


def frozen_dim(names: Names, n: int, sizes: dict) -> str:
    """A new identifier for a dim of length ``n`` that is never split (``^``), its length noted in
    ``sizes``; a dim of length 1 stays the number ``1``."""
    d = names.dim(n)
    if d != "1":
        sizes[d] = n
        d += "^"
    return d


def mark(dim: str, marker: str) -> str:
    """``k`` -> ``k+``; ``1``, numbers and groups are left alone."""
    return dim if (dim.isdigit() or dim.startswith("(")) else dim + marker


def group(factors: Sequence[str]) -> str:
    return factors[0] if len(factors) == 1 else "(" + " ".join(factors) + ")"


def tensor_text(dims: Sequence[str]) -> str:
    """One tensor's annotation; a 0-d tensor is written ``1``."""
    return " ".join(dims) if dims else "1"


def size_arg(items: Sequence[str]) -> Any:
    """A shape argument from per-dim expressions: ``Size("a (b c) -1")``, ``(Size("a"),)`` or ``[]``."""
    if not items:
        return []
    return (Size(items[0]),) if len(items) == 1 else Size(" ".join(items))


def usable(call: OpCall, empty_ok: bool = False) -> bool:
    """False for calls a rule never annotates: tensor kwargs, zero-sized tensors (unless
    ``empty_ok``: a rule that writes an empty dim as ``0``, as phi-3's empty rotary remainder)."""
    if any(isinstance(v, TensorMeta) for v in call.kwargs.values()):
        return False
    metas = [m for a in call.args for m in (a if isinstance(a, (list, tuple)) else (a,))
             if isinstance(m, TensorMeta)]
    metas += [m for m in call.outputs if isinstance(m, TensorMeta)]
    return empty_ok or all(0 not in m.shape for m in metas)


def constraint(meta: TensorMeta) -> Any:
    """Sample values matching a tensor's dtype: masks for bool, small indices for integers, complex
    numbers for complex tensors."""
    if meta.dtype == torch.bool:
        return Mask()
    if meta.dtype.is_complex:
        return Complex()
    if not (meta.dtype.is_floating_point or meta.dtype.is_complex):
        return Index(5, str(meta.dtype).removeprefix("torch."))
    return None


@dataclass(frozen=True)
class Regroup:
    """``fn(*flat)`` for an op taking lists of tensors: for each ``(pos, n)`` of ``lists``, the flat
    inputs ``pos .. pos+n-1`` (positions among the flat inputs) are passed to the ATen overload
    ``op`` (by name, e.g. ``"aten.cat.default"``) as one list. The compiler flattens list arguments
    the same way (one annotated input per tensor): ``cat`` has one list, ``lstm`` two (states and
    weights)."""

    op: str
    lists: tuple[tuple[int, int], ...]

    def __call__(self, *flat, **kwargs):
        args, at = [], 0
        for pos, n in self.lists:
            args += list(flat[at:pos]) + [list(flat[pos:pos + n])]
            at = pos + n
        return aten_overload(self.op)(*args, *flat[at:], **kwargs)


def short_name(overload: str) -> str:
    """``aten.view.default`` -> ``view``; ``aten.add.Tensor`` -> ``add.Tensor``."""
    return overload.removeprefix("aten.").removesuffix(".default")


def build(call: OpCall, family: str, ins: Mapping[int, Sequence[str] | Sequence[Sequence[str]]],
          outs: Sequence[Sequence[str]], *, args: Mapping[int, Any] | None = None,
          kwargs: Mapping[str, Any] | None = None, fn: Callable | None = None,
          inputs: Mapping[int, Any] | None = None, **options) -> OpSpec:
    """The spec of ``call``: ``ins[pos]`` are the dims of the tensor at argument ``pos`` (for a list
    of tensors, one list of dims per tensor, flattened in place); every other argument is ``?`` with
    its value, or ``args[pos]`` where given. ``inputs`` (constraints) are keyed by argument position
    (a list of them for a list of tensors);
    tensors without one get :func:`constraint` of their dtype."""
    texts, values, cons = [], {}, {}
    lists = []
    for pos, a in enumerate(call.args):
        if pos in ins and isinstance(a, (list, tuple)):
            a = [m for m in a if m is not None]  # leading Nones (x[:, i]): the compiler drops them too
            lists.append((len(texts), len(a)))
            given = (inputs or {}).get(pos)
            for k, (meta, dims) in enumerate(zip(a, ins[pos])):
                c = given[k] if isinstance(given, (list, tuple)) else constraint(meta)
                if c is not None:
                    cons[len(texts)] = c
                texts.append(tensor_text(dims))
        elif pos in ins:
            c = (inputs or {}).get(pos, constraint(a))
            if c is not None:
                cons[len(texts)] = c
            texts.append(tensor_text(ins[pos]))
        else:
            values[len(texts)] = (args or {}).get(pos, a)
            texts.append("?")
    annotation = ", ".join(texts) + " -> " + ", ".join(tensor_text(d) for d in outs)
    op = fn or aten_overload(call.overload)
    if lists and fn is None:
        op = Regroup(call.overload, tuple(lists))
    floating = [m.dtype.is_floating_point for m in call.outputs if isinstance(m, TensorMeta)]
    options.setdefault("differentiable", any(floating) if floating else True)
    return OpSpec.create(f"rule.{short_name(call.overload)}", annotation, op, args=values,
                         kwargs=dict(call.kwargs if kwargs is None else kwargs), inputs=cons,
                         family=family, aten=(call.overload,), **options)


def broadcast(names: Names, shapes: Sequence[tuple[int, ...]], out: tuple[int, ...] | None = None,
              hints: Sequence[str | None] = ()) -> tuple[list[list[str]], list[str]] | None:
    """Dims of tensors broadcast together (aligned from the right): a shared identifier per output
    dim, ``1`` where a tensor broadcasts. ``None`` if the shapes do not broadcast to ``out``."""
    try:
        full = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None
    if out is not None and tuple(out) != full:
        return None
    hints = list(hints) + [None] * (len(full) - len(hints))
    odims = [names.dim(n, h) for n, h in zip(full, hints)]
    per = []
    for shape in shapes:
        lead = len(full) - len(shape)
        per.append([odims[lead + i] if n == full[lead + i] else "1" for i, n in enumerate(shape)])
    return per, odims


def reshape_dims(names: Names, src: Sequence[int], dst: Sequence[int]) -> tuple[list[str], list[str]] | None:
    """Dims of a reshape ``src -> dst`` (same element count), row-major order kept.

    Runs of dims with equal products are refined into common factors, one identifier each: a
    split dim is a group in the input (``(a b) -> a b``), a merge a group in the output, and
    ``a (b c) -> (a b) c`` where both happen. A run with no common refinement (``6 4 -> 4 6``) is
    written as fixed numbers. Length-1 dims are ``1``."""
    a = [n for n in src if n != 1]
    b = [n for n in dst if n != 1]
    prod_a, prod_b = 1, 1
    for n in a:
        prod_a *= n
    for n in b:
        prod_b *= n
    if prod_a != prod_b or 0 in a or 0 in b:
        return None
    fa: list[list[str]] = [[] for _ in a]
    fb: list[list[str]] = [[] for _ in b]
    i = j = 0
    while i < len(a):
        i0, j0, pa, pb = i, j, a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa, i = pa * a[i], i + 1
            else:
                pb, j = pb * b[j], j + 1
        if not _refine(names, a[i0:i], b[j0:j], fa[i0:i], fb[j0:j]):
            for k in range(i0, i):
                fa[k] = [str(a[k])]
            for k in range(j0, j):
                fb[k] = [str(b[k])]
    it_a, it_b = iter(fa), iter(fb)
    return ([("1" if n == 1 else group(next(it_a))) for n in src],
            [("1" if n == 1 else group(next(it_b))) for n in dst])


def _refine(names: Names, a: list[int], b: list[int], fa: list[list[str]], fb: list[list[str]]) -> bool:
    i = j = 0
    ra, rb = a[0], b[0]
    while i < len(a):
        f = min(ra, rb)
        if max(ra, rb) % f:
            return False
        name = names.new()
        fa[i].append(name)
        fb[j].append(name)
        ra, rb = ra // f, rb // f
        if ra == 1:
            i += 1
            ra = a[i] if i < len(a) else 1
        if rb == 1:
            j += 1
            rb = b[j] if j < len(b) else 1
    return True


# --- verified examples ------------------------------------------------------------------------------
EXAMPLES_FAMILY = "rules"
EXAMPLES: dict[str, list[str]] = {}  # overload -> names of its registered examples
_CALLS: dict[str, tuple[str, "ex"]] = {}  # example name -> (overload, its call), to derive it again


def T(*shape: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def I(*shape: int) -> TensorMeta:  # noqa: E743
    """An int64 tensor argument by shape."""
    return T(*shape, dtype=torch.int64)


def B(*shape: int) -> TensorMeta:
    """A bool tensor argument by shape."""
    return T(*shape, dtype=torch.bool)


@dataclass(frozen=True)
class ex:  # noqa: N801  (reads as a call in example lists)
    """One example call: positional and keyword arguments, tensors as :func:`T`."""

    args: tuple
    kwargs: dict

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)


def _real(value: Any) -> Any:
    if isinstance(value, TensorMeta):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_real(v) for v in value)
    return value


def _meta(value: Any) -> Any:
    return TensorMeta(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None


def make_call(overload: str, args: tuple, kwargs: dict | None = None) -> OpCall:
    """The :class:`OpCall` of running ``overload`` on zeros of these shapes."""
    kwargs = dict(kwargs or {})
    out = aten_overload(overload)(*_real(args), **kwargs)
    outs = tuple(_meta(o) for o in out) if isinstance(out, (list, tuple)) else (_meta(out),)
    return OpCall(overload, tuple(args), kwargs, outs)


def derive(call: OpCall, registry: OpRegistry | None = None) -> OpSpec | None:
    """The spec of the first rule of ``call.overload`` that annotates ``call`` (``None`` if none)."""
    for rule in (registry or DEFAULT_REGISTRY).rules(call.overload):
        spec = rule(call)
        if spec is not None:
            return spec
    return None


def shapes_of(call: OpCall) -> tuple[list, list]:
    """Input shapes (lists of tensors flattened in place, as the compiler does; ``None`` for
    non-tensors) and output shapes: what a derived annotation must bind."""
    ins = [a.shape if isinstance(a, TensorMeta) else None for a in flatten_tensor_lists(call.args)]
    outs = [m.shape if isinstance(m, TensorMeta) else None for m in call.outputs]
    return ins, (None if None in outs else outs)  # None: an op returning nothing


def register_examples(overload: str, calls: Iterable[ex | tuple]) -> list[str]:
    """Derive each example's spec with the registered rules and add it to the default registry.

    Raises if no rule annotates an example or its annotation does not bind to the example's shapes
    (a broken rule fails at import, not in the middle of a sweep)."""
    names = EXAMPLES.setdefault(overload, [])
    for c in calls:
        c = c if isinstance(c, ex) else ex(*c)
        call = make_call(overload, c.args, c.kwargs)
        spec = derive(call)
        if spec is None:
            raise ValueError(f"no rule annotates the example {call}")
        bind(spec.anno, *shapes_of(call), known=dict(spec.sizes) or None)
        name = f"rule.{short_name(overload)}.{len(names)}"
        DEFAULT_REGISTRY.add(replace(spec, name=name, family=EXAMPLES_FAMILY))
        names.append(name)
        _CALLS[name] = (overload, c)
    return names


def rederive_examples() -> list[str]:
    """Derive every registered example again with the rules as they stand now (each was derived once, when
    its family was imported): a rule changed later (a rule added ``first``, a mutant of the catalogue) then
    reaches the operator cases too. Returns the names whose annotation changed."""
    changed = []
    for name, (overload, c) in _CALLS.items():
        spec = derive(make_call(overload, c.args, c.kwargs))
        if spec is None:
            raise ValueError(f"no rule annotates the example {name} any more")
        new = replace(spec, name=name, family=EXAMPLES_FAMILY)
        if new.annotation != DEFAULT_REGISTRY.get(name).annotation:
            changed.append(name)
        DEFAULT_REGISTRY.rederive(new)
    return changed
