"""The dimops annotation grammar: ``b m k+, b k+ n -> b m n``.

An annotation names every dimension of every tensor argument and result of an operator:

* an identifier (``b``) names a length; the same identifier means the same length;
* a number (``1``, ``3``) is a fixed length;
* ``*`` stands for any number of leading/inner dims, the same in every tensor that has one;
* ``?`` is a non-tensor (or opaque) argument;
* ``(h d)`` is one real dim made of hidden factors; only the first factor may be split, unless
  only numbers precede it (``(3 d)``) or it also leads a dim of a tensor of the annotation (a
  reshape's ``a b -> (a b)``): the merged dim is then split in blocks, each rank
  holding its share of ``b`` inside each of the ``a`` blocks (never together with ``a``);
* a marker after an identifier: none = spatially splittable, ``+`` = splittable by value (results
  lacking it become partial sums), ``^`` = frozen, never split; a number may carry ``^`` (``2^``,
  numbers are never split anyway) and ``*^`` is a frozen star (its dims are never split);
* an identifier may name several whole dims of one tensor (``l l`` for a square matrix, as in
  ``inv``, ``eye`` or window ops). Such an identifier is never split: splitting both dims of a
  square matrix by one factor keeps only its diagonal blocks on each rank (the off-diagonal blocks
  belong to no one), which no per-axis layout can express;
* the input side may be empty (``-> a b``): a creator (``zeros``, ``arange``) whose sizes come
  from ``?`` arguments or keyword arguments (``Size("a b")`` in the registry);
* an output ``?`` is one opaque result (a list or tuple the function returns, a shape, ...): it is
  never split, every rank computes it, and the harness compares it with the reference as a whole.

Inputs under a value split. When a ``+`` identifier is split, an input lacking it is **replicated**
by default (nnScaler's rule): right for an input entering the computation that is summed, as the
activation of a fused MLP ``b s h^, h^ f+, f+, f+ h^ -> b s h^`` (``x`` lacks ``f``; each rank computes
``gelu(x @ W1[:, f] + b1[f]) @ W2[f, :]`` from the whole ``x``) or a scale multiplying the sum. An
input written with a leading ``+`` is instead a **partial value** held by one rank (the others hold
zeros): right for a term added after the contraction, as the bias of ``addmm``
``+n, m k+, k+ n -> m n`` or of a linear layer ``* k+, n k+, +n -> * n``. The wrong choice is caught
by the harness: a replicated bias is counted once per rank, a partial activation is zero on all
ranks but one.

:func:`parse` turns the text into an :class:`OpAnno`; errors name the column, and a construct the
grammar lacks (``...``, nested groups, ``*+``, ``2+``) is named, never reinterpreted.
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
    partial: bool = False  # written ``+x``: a partial value under a split '+' identifier it lacks

    @property
    def has_star(self) -> bool:
        return any(len(d.idents) == 1 and d.idents[0].is_star for d in self.dims)

    def __str__(self) -> str:
        return "?" if self.opaque else ("+" if self.partial else "") + " ".join(str(d) for d in self.dims)

    def names(self) -> set[str]:
        """Named identifiers of this tensor (numbers and ``*`` excluded)."""
        return {i.name for d in self.dims for i in d.idents if not (i.is_number or i.is_star)}


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

    def star_marker(self) -> str:
        """The marker of ``*`` (``^`` for a frozen star, else none)."""
        return next((i.marker for t in self.inputs + self.outputs for d in t.dims for i in d.idents
                     if i.is_star), SPATIAL)

    def repeated(self) -> set[str]:
        """Identifiers naming more than one dim of some tensor (``l l``): never split."""
        out: set[str] = set()
        for t in self.inputs + self.outputs:
            seen: set[str] = set()
            for d in t.dims:
                for i in d.idents:
                    if not (i.is_number or i.is_star):
                        (out if i.name in seen else seen).add(i.name)
        return out

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        return (ins + " " if ins else "") + "-> " + ", ".join(map(str, self.outputs))


_TOKEN = re.compile(r"\s*(?:(?P<arrow>->)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<num>[0-9]+)"
                    r"|(?P<punct>[,()*?+^])|(?P<ellipsis>\.\.\.|…))")


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
        if kind == "ellipsis":
            raise _error(text, m.start(kind), "'...' (einops ellipsis) is not part of the grammar; write '*' "
                                              "for any number of dims")
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
            if self.peek()[0] == "punct" and self.peek()[1] == "+":
                raise self.fail(f"construct '{val}+' (a fixed number split by value) is not supported: a "
                                f"fixed number is never split; write '{val}' or '{val}^'")
            if self.peek()[0] == "punct" and self.peek()[1] == "^":
                self.take()
                return Ident(val, FROZEN, col)
            return Ident(val, col=col)
        if kind == "punct" and val == "*":
            if in_group:
                raise _error(self.text, col, "'*' cannot appear inside a group '( )'")
            if self.peek()[0] == "punct" and self.peek()[1] == "+":
                raise self.fail("construct '*+' (a star split by value) is not supported; write '*' "
                                "(spatial) or '*^' (frozen), or name the dims")
            if self.peek()[0] == "punct" and self.peek()[1] == "^":
                self.take()
                return Ident(STAR, FROZEN, col)
            return Ident(STAR, col=col)
        if kind == "punct" and val == "(" and in_group:
            raise _error(self.text, col, "construct '( ( ) )' (a group inside a group) is not supported; "
                                         "write the factors in one group")
        if kind != "name":
            raise _error(self.text, col, f"expected an identifier, got {val or 'end of text'!r}")
        marker = SPATIAL
        if self.peek()[0] == "punct" and self.peek()[1] in ("+", "^"):
            marker = self.take()[1]
        return Ident(val, marker, col)

    def tensor(self) -> TensorAnno:
        kind, val, start = self.peek()
        partial = kind == "punct" and val == "+"
        if partial:
            self.take()
            kind, val, _ = self.peek()
        if kind == "punct" and val == "?":
            if partial:
                raise _error(self.text, start, "construct '+?' is not supported: only a tensor can be a partial value")
            self.take()
            if self.peek()[0] == "punct" and self.peek()[1] in ("+", "^"):
                raise self.fail(f"construct '?{self.peek()[1]}' is not supported: '?' takes no marker")
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
        return TensorAnno(tuple(dims), col=start, partial=partial)

    def side(self) -> list[TensorAnno]:
        if self.i == 0 and self.peek()[0] == "arrow":
            return []  # a creator: no tensor input
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
    for t in outputs:
        if t.partial:
            raise _error(text, t.col, "a leading '+' marks an input as a partial value; an output lacking a "
                                      "'+' identifier is one already")
    _check(text, inputs + outputs)
    anno = OpAnno(tuple(inputs), tuple(outputs), text)
    value = {n for n, m in anno.markers().items() if m == VALUE}
    for t in inputs:
        if t.partial and not (value - t.names()):
            raise _error(text, t.col, "a leading '+' makes an input a partial value under a split '+' identifier "
                                      "it lacks, but it lacks none; remove the '+'")
    return anno


def _check(text: str, tensors: list[TensorAnno]) -> None:
    """Each identifier keeps one marker; it may name several whole dims of a tensor (``l l``) but
    never a group factor twice; ``*`` at most once a tensor, with one marker everywhere."""
    seen: dict[str, str] = {}
    star_marker: str | None = None
    for t in tensors:
        names: dict[str, bool] = {}  # name -> seen inside a group
        stars = 0
        for d in t.dims:
            for i in d.idents:
                if i.is_star:
                    stars += 1
                    if star_marker is not None and star_marker != i.marker:
                        raise _error(text, i.col, "'*' and '*^' in one annotation; give '*' one marker everywhere")
                    star_marker = i.marker
                    continue
                if i.is_number:
                    continue
                if i.name in names and (d.grouped or names[i.name]):
                    raise _error(text, i.col, f"identifier {i.name!r} appears twice in one tensor with a group "
                                              f"'( )' involved; only whole dims may repeat ('l l')")
                names[i.name] = names.get(i.name, False) or d.grouped
                if seen.setdefault(i.name, i.marker) != i.marker:
                    raise _error(text, i.col,
                                 f"identifier {i.name!r} has markers {seen[i.name] or 'none'!r} and "
                                 f"{i.marker or 'none'!r}; give it one marker everywhere")
        if stars > 1:
            col = [i.col for d in t.dims for i in d.idents if i.is_star][1]
            raise _error(text, col, "'*' appears more than once in one tensor")
