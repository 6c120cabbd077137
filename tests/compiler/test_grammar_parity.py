"""The grammar says what nnScaler's says: creators, ``l l``, ``2^``, ``*^``, callable annotations,
an opaque ``?`` output, and one rule (with a marker for the other) for inputs under a value split.
Each construct is parsed, bound, partitioned, and verified on real ranks, right and wrong."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nnscaler import OpRegistry, register_op
from nnscaler.dimops import AnnotationError, Partition, bind, enumerate_partitions, op_layout, parse, splittable
from nnscaler.dimops.layout import Partial, Replicate, Shard
from nnscaler.ops.rules import TensorMeta
from nnscaler.trace.build import UnknownOperatorWarning, trace
from verify.config import RunConfig
from verify.rows.run import run_op


# --- parse, bind, partition ---------------------------------------------------------------------

@pytest.mark.parametrize("text", ["-> a b", "?, ? -> a", "* l l -> * l l", "a b, a b -> 2^ a b", "*^ c -> *^ c",
                                  "a^ b^ -> ?", "+n, m k+, k+ n -> m n", "* k+, n k+, +n -> * n"])
def test_new_constructs_round_trip(text):
    assert str(parse(text)) == text
    assert parse(str(parse(text))) == parse(text)


def test_creator_binds_from_outputs_alone():
    b = bind("?, ? -> a b", [None, None], [(4, 6)])
    assert b.sizes == {"a": 4, "b": 6} and b.inputs == (None, None)
    assert [p.label for p in enumerate_partitions(b, 2)] == ["replicate", "a=2", "b=2"]
    b = bind("-> a^ b", [], [(4, 6)])
    assert splittable(b) == ["b"]


def test_repeated_identifier_is_one_length_and_never_split():
    b = bind("* l l -> * l", [(4, 6, 6)], [(4, 6)])
    assert b.sizes["l"] == 6 and splittable(b) == ["*0"]
    with pytest.raises(AnnotationError, match="'l' is 5 here but 6"):
        bind("l l -> l", [(6, 5)])


def test_frozen_star_and_marked_number():
    b = bind("*^ c, 2^ c -> *^ c", [(4, 6, 8), (2, 8)])
    assert b.markers["*0"] == b.markers["*1"] == "^" and splittable(b) == ["c"]
    assert bind("* c -> * c", [(4, 8)]).markers["*0"] == ""


@pytest.mark.parametrize("text, column, construct", [
    ("a 2+ -> a", 4, "'2+'"), ("*+ a -> a", 2, "'*+'"), ("a ... -> a", 3, "'...'"),
    ("((a b) c) -> a", 2, "group inside a group"), ("? ^ -> a", 3, "'?^'"), ("+?, a k+ -> a", 1, "'+?'"),
    ("(l l) -> l", 4, "only whole dims may repeat"), ("a k+ -> +a", 9, "an output"),
    ("+a k+, a k+ -> a", 1, "lacks none"), ("*^ a, * -> a", 7, "'*^'"),
])
def test_missing_constructs_are_named_with_their_column(text, column, construct):
    with pytest.raises(AnnotationError) as info:
        parse(text)
    assert f"column {column}:" in str(info.value) and construct in str(info.value), str(info.value)


def test_value_split_inputs_replicate_unless_marked_partial():
    b = bind("b h^, h^ f+, f+, +h^, f+ h^ -> b h^", [(4, 6), (6, 8), (8,), (6,), (8, 6)])
    lay = op_layout(b, Partition.parse("f=2", 2))
    assert lay.inputs == ((Replicate(),), (Shard(1),), (Shard(0),), (Partial(),), (Shard(0),))
    assert lay.outputs == ((Partial(),),)
    # a non-floating input is never a partial value, marked or not
    assert op_layout(b, Partition.parse("f=2", 2), [True, True, True, False, True]).inputs[3] == (Replicate(),)


@settings(deadline=None, max_examples=60)
@given(st.lists(st.booleans(), min_size=1, max_size=4), st.sampled_from([2, 4]))
def test_layout_rule_property(marks, world):
    """Every input lacking the split '+' identifier is V exactly when written '+x', else R."""
    ins = [("+" if m else "") + f"x{i}" for i, m in enumerate(marks)]
    text = ", ".join(["m k+", "k+ n"] + ins) + " -> m n"
    shapes = [(4, 4), (4, 4)] + [(4,)] * len(marks)
    lay = op_layout(bind(text, shapes), Partition.parse(f"k={world}", world))
    for m, layout in zip(marks, lay.inputs[2:]):
        assert layout == ((Partial(),) if m else (Replicate(),))


# --- callable annotations -------------------------------------------------------------------------

def test_callable_annotation_registers_its_examples(registry):
    assert registry.get("g.sum_dim.0").annotation == "a b+, ? -> a"
    assert registry.get("g.sum_dim.1").annotation == "a+ b c, ? -> b c"
    assert registry.get("g.sum_dim.2").annotation == "a+, ? -> 1"
    assert registry.get("g.sum_dim.1").args == {1: 0}


@torch.library.custom_op("nnscaler_grammar::rowsum", mutates_args=())
def rowsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.sum(dim)


rowsum.register_fake(lambda x, dim: x.sum(dim))


class _UsesRowsum(torch.nn.Module):
    def forward(self, x):
        return rowsum(x, 1) * 2


def test_callable_annotation_annotates_every_traced_call():
    reg = OpRegistry()
    register_op(lambda x, dim: "a b+, ? -> a" if dim == 1 else "a+ b, ? -> b", "rowsum", registry=reg)(rowsum)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        g = trace(_UsesRowsum(), (torch.randn(4, 6),), registry=reg)
    (op,) = [op for op in g.ops if op.overload == "nnscaler_grammar.rowsum.default"]
    assert op.spec.annotation == "a b+, ? -> a" and op.bound.sizes == {"a": 4, "b": 6}
    assert op.layout(Partition.parse("b=2", 2)).outputs == ((Partial(),),)


def test_callable_annotation_errors_name_the_op():
    reg = OpRegistry()
    with pytest.raises(AnnotationError, match="'bad.0'.*failed"):
        register_op(lambda x: 1 / 0, "bad", registry=reg, examples=[(TensorMeta((2,)),)])(torch.neg)
    with pytest.raises(AnnotationError, match="needs examples"):
        register_op(lambda x: "a -> a", "lonely", registry=reg)(torch.neg)
    with pytest.raises(AnnotationError, match="column"):
        register_op(lambda x: "a 2+ -> a", "bad2", registry=reg, examples=[(TensorMeta((2, 2)),)])(torch.neg)


# --- on real ranks --------------------------------------------------------------------------------

def _rows(gang, registry, name):
    return list(run_op(gang, registry.get(name), RunConfig(world_sizes=(2, 4), seeds=(0, 1))))


@pytest.mark.parametrize("name", [
    "g.zeros", "g.full", "g.arange", "g.eye", "g.eye_rect", "g.inv", "g.diagonal", "g.trace", "g.triu",
    "g.stack2", "g.roll_star", "g.chunk", "g.svd", "g.size1", "g.split_rows", "g.sum_dim.0", "g.sum_dim.1",
    "g.sum_dim.2", "g.fused_mlp", "g.fused_attention", "g.addmm", "g.scaled_mm"])
def test_construct_verifies_on_real_ranks(gang, registry, name):
    rows = _rows(gang, registry, name)
    assert rows and all(r.ok for r in rows), [(r.world_size, r.partition, r.status, r.detail) for r in rows if not r.ok]


@pytest.mark.parametrize("name", [
    "g.wrong_arange", "g.wrong_eye_rect", "g.wrong_roll_star", "g.wrong_chunk", "g.wrong_size", "g.wrong_sum_dim.0",
    "g.wrong_fused_mlp", "g.wrong_fused_attention", "g.wrong_addmm", "g.wrong_scaled_mm"])
def test_wrong_use_of_a_construct_is_caught(gang, registry, name):
    rows = _rows(gang, registry, name)
    assert any(r.status == "MISMATCH" for r in rows), [(r.partition, r.status) for r in rows]
    assert all(r.ok for r in rows if r.partition == "replicate")  # the op itself runs


def test_every_fixture_op_is_tested(registry):
    tested = set(test_construct_verifies_on_real_ranks.pytestmark[0].args[1]) | set(
        test_wrong_use_of_a_construct_is_caught.pytestmark[0].args[1])
    assert {s.name for s in registry if s.family.startswith("test-grammar")} == tested


# --- the new constructs, drawn at random ----------------------------------------------------------

LENGTHS = {"a": 4, "b": 2, "c": 6, "l": 4}


@st.composite
def _annotations(draw):
    """Annotations mixing repeated whole dims, marked numbers, a (frozen) star and '+' inputs."""
    markers = {n: draw(st.sampled_from(["", "+", "^"])) for n in LENGTHS}
    star = draw(st.sampled_from([None, "", "^"]))

    def tensor():
        dims = draw(st.lists(st.sampled_from(["a", "b", "c", "l", "l l", "2^", "3"]), min_size=1, max_size=3))
        words = [" ".join(n if n[0].isdigit() else n + markers[n] for n in d.split()) for d in dims]
        if star is not None and draw(st.booleans()):
            words.insert(draw(st.integers(0, len(words))), "*" + star)
        return " ".join(words)

    ins = [tensor() for _ in range(draw(st.integers(1, 3)))]
    outs = [tensor() for _ in range(draw(st.integers(1, 2)))]
    partial = [draw(st.booleans()) for _ in ins]
    return ", ".join(("+" if p else "") + t for p, t in zip(partial, ins)) + " -> " + ", ".join(outs), partial


def _shape(text: str) -> tuple:
    return tuple(n for w in text.split() for n in ([2, 2] if w.startswith("*") else
                                                   [int(w.rstrip("^"))] if w[0].isdigit() else [LENGTHS[w.rstrip("+^")]]))


@settings(deadline=None, max_examples=150)
@given(_annotations())
@example(("+b+, +l+ -> a", [True, True]))
def test_new_constructs_parse_bind_and_partition(drawn):
    text, partial = drawn
    ins, outs = (side.split(", ") for side in text.split(" -> "))
    value = {w.lstrip("+").rstrip("+") for w in text.replace(",", " ").split() if w.endswith("+") and w != "->"}
    lacks_none = [p and not (value - {w.lstrip("+").rstrip("+^") for w in t.split()}) for p, t in zip(partial, ins)]
    if any(lacks_none):
        with pytest.raises(AnnotationError, match="lacks none"):
            parse(text)
        return
    anno = parse(text)
    assert str(anno) == text and [t.partial for t in anno.inputs] == partial
    b = bind(anno, [_shape(t.lstrip("+")) for t in ins], [_shape(t) for t in outs])
    repeated = {n for t in ins + outs for n in "abcl" if [w.lstrip("+").rstrip("+^") for w in t.split()].count(n) > 1}
    assert anno.repeated() == repeated
    for ident in splittable(b):
        assert ident not in repeated and b.markers[ident] != "^"
    for p in enumerate_partitions(b, 2):
        lay = op_layout(b, p)
        (ident,) = [i for i, _ in p.splits] or [None]
        for t, dims, layout in zip(anno.inputs, b.inputs, lay.inputs):
            holds = any(ids[0] == ident for ids in dims)
            want = Shard if holds else Partial if (t.partial and b.markers.get(ident) == "+") else Replicate
            assert all(isinstance(x, want) for x in layout) or ident is None, (text, p.label, layout)
