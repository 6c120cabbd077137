"""The dimops annotation grammar: parsing, printing, and errors that point at the column."""
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnscaler.dimops.grammar import AnnotationError, OpAnno, parse

from _dimops_strategies import Anno, annotations

SETTINGS = settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])


def model_of(anno: OpAnno) -> tuple:
    """The parse tree as plain data: per tensor None (`?`) or a list of (tokens, grouped)."""
    def tensor(t):
        if t.opaque:
            return None
        return [(tuple(i.name for i in d.idents), d.grouped) for d in t.dims]
    return [tensor(t) for t in anno.inputs], [tensor(t) for t in anno.outputs]


def error_column(text: str) -> int:
    with pytest.raises(AnnotationError) as info:
        parse(text)
    m = re.search(r"column (\d+)\b", str(info.value))
    assert m, f"no column in {info.value}"
    return int(m.group(1))


# --- the example annotations ----------------------------------------------------------------------

def test_matmul():
    a = parse("b m k+, b k+ n -> b m n")
    assert model_of(a) == ([[(("b",), False), (("m",), False), (("k",), False)],
                            [(("b",), False), (("k",), False), (("n",), False)]],
                           [[(("b",), False), (("m",), False), (("n",), False)]])
    assert a.markers() == {"b": "", "m": "", "k": "+", "n": ""}
    assert str(a) == "b m k+, b k+ n -> b m n"


def test_star():
    a = parse("* k+, n k+ -> * n")
    assert [t.has_star for t in a.inputs + a.outputs] == [True, False, True]
    assert a.markers() == {"k": "+", "n": ""}
    assert a.inputs[0].dims[0].idents[0].is_star


def test_frozen():
    a = parse("a b^ -> a b^")
    assert a.markers() == {"a": "", "b": "^"}
    assert str(a) == "a b^ -> a b^"


def test_group():
    a = parse("(h d) s -> h s d")
    assert model_of(a) == ([[(("h", "d"), True), (("s",), False)]],
                           [[(("h",), False), (("s",), False), (("d",), False)]])
    assert len(a.inputs[0].dims) == 2  # a group is one real dim
    assert str(a) == "(h d) s -> h s d"


def test_opaque():
    a = parse("x, ? -> x")
    assert [t.opaque for t in a.inputs] == [False, True]
    assert str(a) == "x, ? -> x"


def test_numbers():
    a = parse("a 3, 1 -> 3 (2 a) 12")
    assert model_of(a) == ([[(("a",), False), (("3",), False)], [(("1",), False)]],
                           [[(("3",), False), (("2", "a"), True), (("12",), False)]])
    assert a.inputs[0].dims[1].idents[0].is_number
    assert a.markers() == {"a": ""}  # numbers are not identifiers


def test_scalar_output_and_whitespace():
    a = parse("  a\tb+ ,c->  a,  ")
    assert model_of(a) == ([[(("a",), False), (("b",), False)], [(("c",), False)]],
                           [[(("a",), False)], []])


def test_not_a_string():
    with pytest.raises(AnnotationError):
        parse(None)


# --- round trip on generated annotations ----------------------------------------------------------

@SETTINGS
@given(annotations())
def test_parse_matches_model_and_round_trips(m: Anno):
    a = parse(m.text)
    assert model_of(a) == (m.inputs, m.outputs)
    assert a.markers() == m.markers
    assert str(a) == m.text
    assert parse(str(a)) == a


def _respace(text: str, draw) -> str:
    """Insert random whitespace between tokens (never inside a name, a number or the arrow)."""
    toks = re.findall(r"->|[A-Za-z0-9_]+|[^\sA-Za-z0-9_]", text)
    out = ""
    for t in toks:
        sep = draw(st.sampled_from(["", " ", "  ", "\t"]))
        if out and re.match(r"\w", t) and re.search(r"\w$", out) and not sep:
            sep = " "
        out += sep + t
    return out + draw(st.sampled_from(["", " ", "\n"]))


@SETTINGS
@given(annotations(), st.data())
def test_whitespace_is_insignificant(m: Anno, data):
    text = _respace(m.text, data.draw)
    a = parse(text)
    assert model_of(a) == (m.inputs, m.outputs)
    assert str(a) == m.text


def test_equal_annotations_compare_equal_whatever_the_spacing():
    assert parse("b m k+,b k+ n->b m n") == parse("b m k+, b k+ n -> b m n")


# --- errors point at the column -------------------------------------------------------------------

BAD = "$!@#%&.;:[]{}=<|~\"'`\\é"


@SETTINGS
@given(annotations(), st.data())
def test_bad_character_column(m: Anno, data):
    text = m.text
    pos = data.draw(st.integers(0, len(text)).filter(lambda p: text[p - 1:p + 1] != "->"), label="pos")
    bad = data.draw(st.sampled_from(BAD), label="bad")
    assert error_column(text[:pos] + bad + text[pos:]) == pos + 1


@pytest.mark.parametrize("text, column, words", [
    ("(h d", 1, "unclosed"),
    ("a (h d", 3, "unclosed"),
    ("2+ a -> a", 2, "split by value"),
    ("a 3+ -> a", 4, "'3+'"),
    ("*+ a -> a", 2, "'*+'"),
    ("a ... -> a", 3, "'...'"),
    ("((a b) c) -> a", 2, "group inside a group"),
    ("? ^ -> a", 3, "'?^'"),
    ("+?, a k+ -> a", 1, "'+?'"),
    ("a k+, +a k+ -> a", 7, "lacks none"),
    ("a k+ -> +a", 9, "an output"),
    ("*, *^ -> *", 4, "'*^'"),
    ("(2+ a) -> a", 3, "split by value"),
    ("a ? -> a", 3, "?"),
    ("a, b ? -> a", 6, "?"),
    ("a -> a ?", 8, "?"),
    ("? a -> a", 3, "'->'"),
    ("(a a) -> a", 4, "twice"),
    ("(a b) a -> a", 7, "twice"),
    ("a -> (a a)", 9, "twice"),
    ("a b+, b -> a", 7, "markers"),
    ("a b+, b+ -> b^", 13, "markers"),
    ("* a * -> a", 5, "more than once"),
    ("a -> * *", 8, "more than once"),
    ("(* a) -> a", 2, "group"),
    ("a (h *) -> a", 6, "group"),
    ("a b", 4, "'->'"),
    ("a, b", 5, "'->'"),
    ("a -> b -> c", 8, "'->'"),
    ("a, -> a", 4, "no dims"),
    ("a, , b -> a", 4, "no dims"),
    ("() -> a", 1, "empty group"),
    ("a -> a)", 7, ")"),
    ("a - > a", 3, "unexpected"),
    ("a+^ -> a", 3, "identifier"),
])
def test_specific_errors(text, column, words):
    with pytest.raises(AnnotationError) as info:
        parse(text)
    msg = str(info.value)
    assert f"column {column}:" in msg
    assert words in msg


def test_unclosed_group_before_arrow_points_at_the_open_paren():
    assert error_column("(h d -> h d") == 1


@pytest.mark.parametrize("text", ["(h d -> h d", "(h d, s -> s"])
def test_unclosed_group_before_arrow_says_unclosed(text):
    with pytest.raises(AnnotationError, match="unclosed"):
        parse(text)
