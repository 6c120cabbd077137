"""The dimops annotation grammar: ``b m k+, b k+ n -> b m n``.

An annotation names every dimension of every tensor argument and result of an operator:

* an identifier (``b``) names a length; the same identifier means the same length;
* a number (``1``, ``3``) is a fixed length;
* ``*`` stands for any number of leading/inner dims, the same in every tensor that has one;
* ``?`` is a non-tensor (or opaque) argument;
* ``(h d)`` is one real dim made of hidden factors; only the first factor may be split;
* a marker after an identifier: none = spatially splittable, ``+`` = splittable by value (results
  lacking it become partial sums), ``^`` = frozen, never split.

:func:`parse` turns the text into an :class:`OpAnno`; errors name the column.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

SPATIAL, VALUE, FROZEN = "", "+", "^"
STAR = "*"


class AnnotationError(ValueError):
    """A malformed annotation, or one that disagrees with concrete shapes."""


@dataclass(frozen=True)
class Ident:
    """One identifier (or fixed number, or ``*``) with its split marker."""

    name: str
    marker: str = SPATIAL
    col: int = field(default=-1, compare=False)  # where it was written, for error messages

    @property
    def is_number(self) -> bool:
        return self.name.isdigit()

    @property
    def is_star(self) -> bool:
        return self.name == STAR

    def __str__(self) -> str:
        return self.name + self.marker


@dataclass(frozen=True)
class Dim:
    """One written dim: a single identifier, or a group ``(h d)`` of hidden factors."""

    idents: tuple[Ident, ...]
    grouped: bool = False

    def __str__(self) -> str:
        inner = " ".join(str(i) for i in self.idents)
        return f"({inner})" if self.grouped else inner


@dataclass(frozen=True)
class TensorAnno:
    """The dims of one tensor; ``opaque`` marks a ``?`` (non-tensor) argument."""

    dims: tuple[Dim, ...] = ()
    opaque: bool = False
    col: int = field(default=-1, compare=False)

    @property
    def has_star(self) -> bool:
        return any(len(d.idents) == 1 and d.idents[0].is_star for d in self.dims)

    def __str__(self) -> str:
        return "?" if self.opaque else " ".join(str(d) for d in self.dims)


@dataclass(frozen=True)
class OpAnno:
    """A parsed annotation: one :class:`TensorAnno` per input and per output."""

    inputs: tuple[TensorAnno, ...]
    outputs: tuple[TensorAnno, ...]
    text: str = field(compare=False)  # as written; equal annotations may differ in spacing

    def markers(self) -> dict[str, str]:
        """Marker of every named identifier (numbers and ``*`` excluded)."""
        out: dict[str, str] = {}
        for t in self.inputs + self.outputs:
            for d in t.dims:
                for i in d.idents:
                    if not (i.is_number or i.is_star):
                        out.setdefault(i.name, i.marker)
        return out

    def __str__(self) -> str:
        return ", ".join(map(str, self.inputs)) + " -> " + ", ".join(map(str, self.outputs))


_TOKEN = re.compile(r"\s*(?:(?P<arrow>->)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<num>[0-9]+)"
                    r"|(?P<punct>[,()*?+^]))")


def _error(text: str, col: int, msg: str) -> AnnotationError:
    return AnnotationError(f"annotation {text!r}, column {col + 1}: {msg}")


def _tokens(text: str) -> list[tuple[str, str, int]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            col = pos + (len(text[pos:]) - len(text[pos:].lstrip()))
            raise _error(text, col, f"unexpected character {text[col]!r}")
        kind = m.lastgroup
        if kind == "name" and out and out[-1][0] == "num" and out[-1][2] + len(out[-1][1]) == m.start(kind):
            raise _error(text, m.start(kind), "a number runs into a name; separate dims with a space")
        out.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    out.append(("end", "", len(text)))
    return out


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> tuple[str, str, int]:
        return self.toks[self.i]

    def take(self) -> tuple[str, str, int]:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def fail(self, msg: str, col: int | None = None) -> AnnotationError:
        return _error(self.text, self.peek()[2] if col is None else col, msg)

    def ident(self, in_group: bool) -> Ident:
        kind, val, col = self.take()
        if kind == "num":
            if self.peek()[1] in ("+", "^"):
                raise self.fail("a fixed number cannot carry a marker")
            return Ident(val, col=col)
        if kind == "punct" and val == "*":
            if in_group:
                raise _error(self.text, col, "'*' cannot appear inside a group '( )'")
            return Ident(STAR, col=col)
        if kind != "name":
            raise _error(self.text, col, f"expected an identifier, got {val or 'end of text'!r}")
        marker = SPATIAL
        if self.peek()[0] == "punct" and self.peek()[1] in ("+", "^"):
            marker = self.take()[1]
        return Ident(val, marker, col)

    def tensor(self) -> TensorAnno:
        kind, val, start = self.peek()
        if kind == "punct" and val == "?":
            self.take()
            return TensorAnno(opaque=True, col=start)
        dims: list[Dim] = []
        while True:
            kind, val, col = self.peek()
            if kind in ("end", "arrow") or (kind == "punct" and val == ","):
                break
            if kind == "punct" and val == "(":
                self.take()
                idents = []
                while not (self.peek()[0] == "punct" and self.peek()[1] == ")"):
                    if self.peek()[0] in ("end", "arrow") or self.peek()[1] == ",":
                        raise _error(self.text, col, "unclosed '('")
                    idents.append(self.ident(in_group=True))
                self.take()
                if not idents:
                    raise _error(self.text, col, "empty group '()'")
                dims.append(Dim(tuple(idents), grouped=True))
            elif kind == "punct" and val == "?":
                raise self.fail("'?' must stand alone for a non-tensor argument")
            else:
                dims.append(Dim((self.ident(in_group=False),)))
        return TensorAnno(tuple(dims), col=start)

    def side(self) -> list[TensorAnno]:
        tensors = [self.tensor()]
        while self.peek()[0] == "punct" and self.peek()[1] == ",":
            self.take()
            tensors.append(self.tensor())
        return tensors


def parse(text: str) -> OpAnno:
    """Parse an annotation; raise :class:`AnnotationError` naming the column of any error."""
    if not isinstance(text, str):
        raise AnnotationError(f"annotation must be a string, got {type(text).__name__}")
    p = _Parser(text)
    inputs = p.side()
    if p.peek()[0] != "arrow":
        raise p.fail("expected ',' or '->'")
    p.take()
    outputs = p.side()
    if p.peek()[0] != "end":
        raise p.fail(f"unexpected {p.peek()[1]!r}")
    for t in inputs:
        if not t.dims and not t.opaque:
            raise _error(text, t.col, "an input has no dims; use '?' for a non-tensor argument")
    _check(text, inputs + outputs)
    return OpAnno(tuple(inputs), tuple(outputs), text)


def _check(text: str, tensors: list[TensorAnno]) -> None:
    """Each identifier keeps one marker, appears once per tensor, ``*`` at most once a tensor."""
    seen: dict[str, str] = {}
    for t in tensors:
        names: set[str] = set()
        stars = 0
        for d in t.dims:
            for i in d.idents:
                if i.is_star:
                    stars += 1
                    continue
                if i.is_number:
                    continue
                if i.name in names:
                    raise _error(text, i.col, f"identifier {i.name!r} appears twice in one tensor")
                names.add(i.name)
                if seen.setdefault(i.name, i.marker) != i.marker:
                    raise _error(text, i.col,
                                 f"identifier {i.name!r} has markers {seen[i.name] or 'none'!r} and "
                                 f"{i.marker or 'none'!r}; give it one marker everywhere")
        if stars > 1:
            col = [i.col for d in t.dims for i in d.idents if i.is_star][1]
            raise _error(text, col, "'*' appears more than once in one tensor")
