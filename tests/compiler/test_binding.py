"""Binding annotations to concrete shapes: every identifier gets exactly one length."""
import pytest
from hypothesis import HealthCheck, given, settings

from nnscaler.dimops.binding import bind
from nnscaler.dimops.grammar import AnnotationError, parse
from nnscaler.ops.spec import Size

from _dimops_strategies import bound_cases

SETTINGS = settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])


def bind_error(*args, **kw) -> str:
    with pytest.raises(AnnotationError) as info:
        bind(*args, **kw)
    return str(info.value)


def test_sizes_from_shapes():
    b = bind("b m k+, b k+ n -> b m n", [(2, 3, 4), (2, 4, 5)])
    assert b.sizes == {"b": 2, "m": 3, "k": 4, "n": 5}
    assert b.markers == {"b": "", "m": "", "k": "+", "n": ""}
    assert b.inputs == ((("b",), ("m",), ("k",)), (("b",), ("k",), ("n",)))
    assert b.outputs == ((("b",), ("m",), ("n",)),)
    assert b.shape(b.outputs[0]) == (2, 3, 5)
    assert b.identifiers() == ["b", "m", "k", "n"]


def test_accepts_parsed_annotation_and_opaque_arguments():
    b = bind(parse("x, ? -> x"), [(7,), None])
    assert b.sizes == {"x": 7}
    assert b.inputs == ((("x",),), None)


def test_tensor_where_annotation_says_opaque_is_ignored_but_missing_tensor_is_an_error():
    msg = bind_error("x, y -> x", [(7,), None])
    assert "input 1" in msg


def test_star_expands_with_the_same_length_everywhere():
    b = bind("* k+, n k+ -> * n", [(2, 3, 4), (5, 4)], [(2, 3, 5)])
    assert b.sizes == {"*0": 2, "*1": 3, "k": 4, "n": 5}
    assert b.inputs[0] == (("*0",), ("*1",), ("k",))
    assert b.outputs[0] == (("*0",), ("*1",), ("n",))
    assert b.markers["*0"] == b.markers["*1"] == ""


def test_star_may_cover_no_dims():
    b = bind("* a -> * a", [(3,)])
    assert b.inputs == ((("a",),),) and b.outputs == ((("a",),),)


def test_star_without_outputs_expands_outputs_too():
    b = bind("* a -> * a", [(2, 3, 4)])
    assert b.outputs == ((("*0",), ("*1",), ("a",)),)


def test_star_length_mismatch():
    msg = bind_error("* a, * a -> * a", [(2, 3, 4), (3, 4)])
    assert "input 1" in msg and "'*'" in msg and "1" in msg and "2" in msg


def test_star_sizes_mismatch_names_dim():
    msg = bind_error("* a, * a -> * a", [(2, 3, 4), (2, 5, 4)])
    assert "input 1" in msg and "dim 1" in msg and "5" in msg and "3" in msg


def test_star_needs_enough_dims():
    assert "at least 2" in bind_error("* a b -> a", [(3,)])


def test_length_mismatch_names_tensor_dim_and_both_lengths():
    msg = bind_error("b m k+, b k+ n -> b m n", [(2, 3, 4), (2, 5, 6)])
    assert "input 1" in msg and "dim 1" in msg and "'k'" in msg
    assert "5" in msg and "4" in msg and "input 0" in msg  # where the other length came from


def test_output_length_mismatch():
    msg = bind_error("a -> a", [(2,)], [(3,)])
    assert "output 0" in msg and "dim 0" in msg and "3" in msg and "2" in msg


def test_known_sizes_are_checked():
    msg = bind_error("a -> a", [(2,)], known={"a": 3})
    assert "given" in msg and "2" in msg and "3" in msg


def test_rank_mismatch():
    msg = bind_error("a b -> a", [(2, 3, 4)])
    assert "input 0" in msg and "3" in msg and "2" in msg
    assert "input 0" in bind_error("a b -> a", [()])


def test_wrong_number_of_tensors():
    bind_error("a, b -> a", [(2,)])
    bind_error("a -> a, a", [(2,)], [(2,)])


def test_fixed_numbers():
    b = bind("a 3 -> a", [(2, 3)])
    assert b.sizes == {"a": 2}
    msg = bind_error("a 3 -> a", [(2, 4)])
    assert "input 0" in msg and "dim 1" in msg and "3" in msg and "4" in msg


def test_one_binds_a_scalar():
    b = bind("1, a -> a", [(), (4,)])
    assert b.inputs == ((), (("a",),))
    assert bind("1 -> 1", [(1,)], [()]).outputs == ((),)
    assert "input 0" in bind_error("2 -> 2", [()])  # only `1` names a 0-d tensor


def test_group_solved_from_other_factor():
    b = bind("(h d) s -> h s d", [(12, 5)], known={"h": 3})
    assert b.sizes == {"h": 3, "d": 4, "s": 5}
    assert b.inputs == ((("h", "d"), ("s",)),)
    b = bind("(h d), h -> d", [(12,), (4,)])
    assert b.sizes == {"h": 4, "d": 3}
    assert bind("(2 h) -> h", [(8,)]).sizes == {"h": 4}


def test_group_solved_through_a_chain_of_groups():
    b = bind("(a b), (b c), c -> a", [(6,), (10,), (5,)])
    assert b.sizes == {"a": 3, "b": 2, "c": 5}


def test_group_solved_from_outputs():
    b = bind("(h d) s -> h s d", [(12, 5)], [(3, 5, 4)])
    assert b.sizes == {"h": 3, "d": 4, "s": 5}


def test_group_with_two_unknowns_is_an_error():
    msg = bind_error("(h d) s -> h s d", [(12, 5)])
    assert "(h d)" in msg and "12" in msg and "input 0" in msg


def test_group_inconsistent():
    assert "15" in bind_error("(h d), h, d -> h", [(12,), (3,), (5,)])
    assert "12" in bind_error("(h d), h -> d", [(12,), (5,)])


def test_output_binding_adds_output_only_identifiers():
    assert "b" not in bind("a -> a b", [(2,)]).sizes
    b = bind("a -> a b", [(2,)], [(2, 5)])
    assert b.sizes == {"a": 2, "b": 5}
    assert b.identifiers() == ["a", "b"]


@SETTINGS
@given(bound_cases())
def test_binding_recovers_the_sizes(case):
    anno, sizes, star_sizes, ins, outs = case
    b = bind(anno.text, ins, outs)
    expected = dict(sizes)
    if anno.has_star():
        expected.update({f"*{k}": n for k, n in enumerate(star_sizes)})
    assert b.sizes == expected
    assert [b.shape(d) if d is not None else None for d in b.inputs] == ins
    assert [b.shape(d) if d is not None else None for d in b.outputs] == outs
    assert list(b.inputs) == [None if t is None else tuple(anno.expanded(t, len(star_sizes)))
                              for t in anno.inputs]
    assert {k: v for k, v in b.markers.items() if not k.startswith("*")} == anno.markers


@SETTINGS
@given(bound_cases())
def test_binding_rejects_a_changed_length(case):
    """Lengthen one input dim that is a number or a plain identifier another tensor also has."""
    anno, sizes, star_sizes, ins, outs = case
    dims = [anno.expanded(t, len(star_sizes)) for t in anno.tensors()]
    for i, t in enumerate(dims[:len(ins)]):
        for pos, ids in enumerate(t or []):
            shared = any((ids in other) for j, other in enumerate(dims) if j != i and other)
            if len(ids) == 1 and (ids[0].isdigit() or shared):
                bad = list(ins)
                bad[i] = ins[i][:pos] + (ins[i][pos] + 1,) + ins[i][pos + 1:]
                with pytest.raises(AnnotationError):
                    bind(anno.text, bad, outs)
                return


# --- Size: non-tensor arguments written in annotation syntax ---------------------------------------

def test_size_resolve():
    sizes = {"a": 2, "h": 3, "d": 4}
    assert Size("a (h d) -1").resolve(sizes) == (2, 12, -1)
    assert Size("h").resolve(sizes) == 3 and isinstance(Size("h").resolve(sizes), int)
    assert Size("(h d)").resolve(sizes) == 12
    assert Size("a 5").resolve(sizes) == (2, 5)
    assert Size("*0 a").resolve({"*0": 7, "a": 2}) == (7, 2)


def test_size_unknown_identifier():
    with pytest.raises(AnnotationError, match="'x'"):
        Size("a x").resolve({"a": 2})
    with pytest.raises(AnnotationError):
        Size("").resolve({"a": 2})


@pytest.mark.parametrize("expr", ["a (h d", "a $ b", "a) b"])
def test_size_malformed_expression(expr):
    with pytest.raises(AnnotationError):
        Size(expr).resolve({"a": 2, "h": 3, "d": 4, "b": 5})
