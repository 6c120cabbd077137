"""Hypothesis strategies for dimops annotations, shared by test_grammar/test_binding/test_partition.

An annotation is generated as a small model (:class:`Anno`) and rendered to canonical text
(single spaces, ``", "`` between tensors, ``" -> "`` between sides). The model is what the tests
compare the library against, so it is built without using the library.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import strategies as st

_FIRST = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
IDENT = st.builds(lambda a, b: a + b, st.sampled_from(_FIRST),
                  st.text(alphabet=_FIRST + "0123456789", max_size=3))

# A dim is (tokens, grouped); a token is an identifier name, a decimal number, or "*".
Dim = tuple[tuple[str, ...], bool]
Tensor = list[Dim] | None  # None: an opaque `?` argument


@dataclass
class Anno:
    inputs: list[Tensor]
    outputs: list[Tensor]
    markers: dict[str, str]  # marker of every identifier present

    def tensors(self) -> list[Tensor]:
        return self.inputs + self.outputs

    def tok(self, t: str) -> str:
        return t + self.markers.get(t, "") if not (t.isdigit() or t == "*") else t

    def render_tensor(self, t: Tensor) -> str:
        if t is None:
            return "?"
        parts = []
        for toks, grouped in t:
            inner = " ".join(self.tok(x) for x in toks)
            parts.append(f"({inner})" if grouped else inner)
        return " ".join(parts)

    @property
    def text(self) -> str:
        return (", ".join(map(self.render_tensor, self.inputs)) + " -> "
                + ", ".join(map(self.render_tensor, self.outputs)))

    def names(self) -> set[str]:
        return {x for t in self.tensors() for toks, _ in (t or []) for x in toks
                if not (x.isdigit() or x == "*")}

    def has_star(self) -> bool:
        return any(toks == ("*",) and not g for t in self.tensors() for toks, g in (t or []))

    def expanded(self, t: Tensor, star_len: int) -> list[tuple[str, ...]] | None:
        """Real dims of a tensor as identifier tuples, ``*`` expanded to ``*0 .. *{star_len-1}``."""
        if t is None:
            return None
        out: list[tuple[str, ...]] = []
        for toks, grouped in t:
            if toks == ("*",) and not grouped:
                out += [(f"*{k}",) for k in range(star_len)]
            else:
                out.append(toks)
        return out

    def shape(self, t: Tensor, sizes: dict[str, int], star_sizes: list[int]):
        if t is None:
            return None
        sizes = {**sizes, **{f"*{k}": n for k, n in enumerate(star_sizes)}}
        return tuple(math.prod(int(x) if x.isdigit() else sizes[x] for x in ids)
                     for ids in self.expanded(t, len(star_sizes)))

    def splittable(self, star_len: int, sizes: dict[str, int] | None = None) -> set[str]:
        """Identifiers a partition may split: not frozen, never a non-first group factor unless
        only numbers precede it (``(3 d)``), or it also leads a dim somewhere and every factor
        before it has a known length (numbers, or names in ``sizes``)."""
        known = sizes or {}
        whole = {toks[0] for t in self.tensors() for toks, _ in (t or [])}
        barred = {x for t in self.tensors() for toks, _ in (t or []) for j, x in enumerate(toks)
                  if j and not all(y.isdigit() for y in toks[:j])
                  and (x not in whole or not all(y.isdigit() or y in known for y in toks[:j]))}
        out = {n for n in self.names() if self.markers[n] != "^" and n not in barred}
        if self.has_star():
            out |= {f"*{k}" for k in range(star_len)}
        return out

    def nested(self, split) -> bool:
        """Whether two of the identifiers ``split`` are factors of one merged dim."""
        return any(len(set(toks) & set(split)) > 1 for t in self.tensors() for toks, _ in (t or []))


@st.composite
def annotations(draw, max_names=5, numbers=st.integers(0, 99), max_dims=4, allow_opaque=True,
                solvable=False, max_inputs=3, max_outputs=2) -> Anno:
    """A well-formed annotation. ``solvable``: every group has at most one factor that never
    appears as a plain dim, so binding to shapes alone determines every length."""
    pool = draw(st.lists(IDENT, min_size=1, max_size=max_names, unique=True))
    markers = {n: draw(st.sampled_from(["", "", "+", "^"])) for n in pool}

    def tensor(is_input: bool, may_be_opaque: bool = True) -> Tensor:
        if allow_opaque and may_be_opaque and draw(st.integers(0, 7)) == 0:
            return None
        used: set[str] = set()
        star = False

        def factor() -> str:
            free = [n for n in pool if n not in used]
            if free and draw(st.integers(0, 3)) < 3:
                n = draw(st.sampled_from(free))
                used.add(n)
                return n
            return str(draw(numbers))

        dims: list[Dim] = []
        for _ in range(draw(st.integers(1 if is_input else 0, max_dims))):
            kind = draw(st.sampled_from(["id", "id", "id", "num", "star", "group"]))
            if kind == "star" and not star:
                star = True
                dims.append((("*",), False))
            elif kind == "group":
                dims.append((tuple(factor() for _ in range(draw(st.integers(1, 3)))), True))
            elif kind == "num":
                dims.append(((str(draw(numbers)),), False))
            else:
                dims.append(((factor(),), False))
        return dims

    n_in = draw(st.integers(1, max_inputs))
    real = draw(st.integers(0, n_in - 1))  # one input is always a tensor
    inputs = [tensor(True, i != real) for i in range(n_in)]
    outputs = [tensor(False) for _ in range(draw(st.integers(1, max_outputs)))]
    anno = Anno(inputs, outputs, {})
    if solvable:
        plain = {toks[0] for t in anno.tensors() for toks, g in (t or []) if not g}
        for t in anno.tensors():
            for i, (toks, g) in enumerate(t or []):
                if g:
                    fixed, seen_unknown = [], False
                    for x in toks:
                        if not x.isdigit() and x not in plain:
                            x = "2" if seen_unknown else x
                            seen_unknown = seen_unknown or not x.isdigit()
                        fixed.append(x)
                    t[i] = (tuple(fixed), g)
    anno.markers = {n: markers[n] for n in anno.names()}
    return anno


@st.composite
def bound_cases(draw, size_values=st.integers(1, 6), max_star=2, **kw):
    """(anno, sizes, star_sizes, input shapes, output shapes) with consistent random lengths."""
    anno = draw(annotations(solvable=True, numbers=st.integers(1, 4), **kw))
    sizes = {n: draw(size_values) for n in sorted(anno.names())}
    star_sizes = draw(st.lists(size_values, max_size=max_star)) if anno.has_star() else []
    ins = [anno.shape(t, sizes, star_sizes) for t in anno.inputs]
    outs = [anno.shape(t, sizes, star_sizes) for t in anno.outputs]
    return anno, sizes, star_sizes, ins, outs
