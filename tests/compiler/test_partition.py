"""The partition space of a bound annotation, the layouts a partition implies, and rank meshes."""
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnscaler.dimops.binding import bind
from nnscaler.dimops.grammar import AnnotationError
from nnscaler.dimops.layout import Partial, Replicate, Shard
from nnscaler.dimops.partition import (Partition, axis_groups, check_partition, coords, enumerate_partitions,
                                       local_sizes, op_layout)
from nnscaler.runtime.mesh import mesh_shapes

from _dimops_strategies import bound_cases

SETTINGS = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
WORLDS = st.sampled_from([1, 2, 3, 4, 6, 8])
CASES = bound_cases(size_values=st.sampled_from([2, 4, 6, 8, 12, 1, 3]), max_names=4)
MATMUL = "b m k+, b k+ n -> b m n"


def brute_force(ids, sizes, world, nested=lambda split: False):
    """Every assignment of a factor (1 = not split) to every identifier, as {ident: factor>1}, never
    two factors of one merged dim (``nested``)."""
    ids = sorted(ids)
    choices = [[f for f in range(1, world + 1) if world % f == 0 and sizes[i] % f == 0] for i in ids]
    out = {frozenset((i, f) for i, f in zip(ids, combo) if f > 1)
           for combo in itertools.product(*choices) if world % math.prod(combo) == 0}
    return {s for s in out if not nested({i for i, _ in s})}


def bound_case(case):
    anno, sizes, star_sizes, ins, outs = case
    b = bind(anno.text, ins, outs)
    all_sizes = {**sizes, **{f"*{k}": n for k, n in enumerate(star_sizes)}}
    return anno, b, all_sizes, len(star_sizes)


# --- the partition space --------------------------------------------------------------------------

@SETTINGS
@given(CASES, WORLDS)
def test_partition_space(case, world):
    anno, b, sizes, star_len = bound_case(case)
    allowed = anno.splittable(star_len, sizes)  # not frozen, not a number, not a group factor after an unknown length
    parts = list(enumerate_partitions(b, world))
    assert parts[0].splits == ()  # pure replication
    for p in parts:
        assert p.world_size == world and world % p.degree == 0
        names = [i for i, _ in p.splits]
        assert len(set(names)) == len(names)
        assert set(names) <= allowed
        assert all(f >= 2 and sizes[i] % f == 0 for i, f in p.splits)
        check_partition(b, p)
        assert Partition.parse(p.label, world) == p
        assert p.mesh_shape in mesh_shapes(world) and math.prod(p.mesh_shape) == world
        assert local_sizes(b, p) == {i: n // p.factor(i) for i, n in sizes.items()}
    assert len({p.label for p in parts}) == len(parts)  # no duplicates
    assert {frozenset(p.splits) for p in parts} == brute_force(allowed, sizes, world, anno.nested)


def test_matmul_on_four_ranks():
    b = bind(MATMUL, [(4, 8, 12), (4, 12, 16)])
    labels = [p.label for p in enumerate_partitions(b, 4)]
    assert len(labels) == 15 and len(set(labels)) == 15
    assert "m=2,k=2" in labels and "replicate" in labels and "k=4" in labels
    assert all(lb.count(",") <= 1 for lb in labels)


def test_small_lengths_limit_the_space():
    b = bind(MATMUL, [(1, 3, 2), (1, 2, 5)])
    assert {p.label for p in enumerate_partitions(b, 6)} == {"replicate", "m=3", "k=2", "m=3,k=2"}
    assert [p.label for p in enumerate_partitions(b, 1)] == ["replicate"]


def test_frozen_numbers_are_never_split_and_inner_factors_split_in_blocks():
    b = bind("a b^ -> a b^", [(4, 4)])
    assert {p.label for p in enumerate_partitions(b, 4)} == {"replicate", "a=2", "a=4"}
    b = bind("(h d) s 4 -> h s", [(16, 3, 4)], known={"h": 4})  # d hidden: a factor only
    assert {p.label for p in enumerate_partitions(b, 4)} == {"replicate", "h=2", "h=4"}
    b = bind("(h d) s 4 -> h s d", [(16, 3, 4)], known={"h": 4})  # d also leads a dim: a reshape
    assert {p.label for p in enumerate_partitions(b, 4)} == {"replicate", "h=2", "h=4", "d=2", "d=4"}
    # d, the inner factor of (h d): each rank holds its share of d inside each of the h blocks
    assert op_layout(b, Partition.parse("d=2", 2)).inputs[0] == (Shard(0, 4),)
    assert op_layout(b, Partition.parse("d=2", 2)).outputs[0] == (Shard(2),)


def test_a_merged_dim_is_never_split_on_two_of_its_factors():
    b = bind("a b c -> (a b) c", [(4, 4, 2)])  # b leads a dim of the input
    labels = {p.label for p in enumerate_partitions(b, 4)}
    assert {"a=2,b=2", "b=2,a=2"}.isdisjoint(labels) and {"a=2,c=2", "b=2,c=2", "b=4"} <= labels
    with pytest.raises(AnnotationError, match="cannot split twice"):
        check_partition(b, Partition.parse("a=2,b=2", 4))


# --- Partition values and checks ------------------------------------------------------------------

def test_partition_properties():
    p = Partition.parse("m=2", 8)
    assert (p.degree, p.replicas, p.mesh_shape, p.axis_ids) == (2, 4, (2, 4), ("m", None))
    assert p.factor("m") == 2 and p.factor("k") == 1
    q = Partition.parse(" m=2 , k=4 ", 8)
    assert (q.degree, q.replicas, q.mesh_shape, q.axis_ids, q.label) == (8, 1, (2, 4), ("m", "k"), "m=2,k=4")
    r = Partition.parse("replicate", 4)
    assert (r.splits, r.mesh_shape, r.axis_ids, r.label) == ((), (4,), (None,), "replicate")
    assert Partition.parse("replicate", 1).mesh_shape == ()


@pytest.mark.parametrize("text", ["m", "m=x", "=2", "m=2,", "m=-2", "m=3"])
def test_partition_parse_errors(text):
    with pytest.raises(AnnotationError):
        Partition.parse(text, 4)


def test_partition_parse_zero_factor():
    with pytest.raises(AnnotationError):
        Partition.parse("m=0", 4)


@pytest.mark.parametrize("label, world, words", [
    ("x=2", 4, "'x'"),           # unknown identifier
    ("f=2", 4, "'f'"),           # frozen
    ("d=2", 4, "'d'"),           # a hidden factor (it leads no dim)
    ("3=3", 3, "'3'"),           # a number
    ("m=4", 4, "not divisible"),  # factor does not divide the length (6)
    ("m=1", 4, "'m'"),           # a factor of 1 is not a split
])
def test_check_partition_rejects(label, world, words):
    b = bind("m f^ (h d) 3 -> m", [(6, 2, 8, 3)], known={"h": 2})
    with pytest.raises(AnnotationError, match=words):
        check_partition(b, Partition.parse(label, world))


def test_check_partition_rejects_degree_not_dividing_world():
    b = bind("m -> m", [(6,)])
    with pytest.raises(AnnotationError):
        check_partition(b, Partition((("m", 3),), 4))


def test_check_partition_rejects_repeated_identifier():
    b = bind("m k -> m", [(6, 4)])
    with pytest.raises(AnnotationError):
        check_partition(b, Partition.parse("m=2,m=2", 4))


# --- layouts --------------------------------------------------------------------------------------

def test_spatial_split_layouts():
    b = bind(MATMUL, [(4, 4, 4), (4, 4, 4)])
    lay = op_layout(b, Partition.parse("m=2", 2))
    assert lay.inputs == ((Shard(1),), (Replicate(),)) and lay.outputs == ((Shard(1),),)
    lay = op_layout(b, Partition.parse("n=4", 4))
    assert lay.inputs == ((Replicate(),), (Shard(2),)) and lay.outputs == ((Shard(2),),)


def test_value_split_layouts():
    b = bind("m k+, k+ n, +m, m, ? -> m n, k+", [(4, 4), (4, 4), (4,), (4,), None], [(4, 4), (4,)])
    p = Partition.parse("k=2", 2)
    lay = op_layout(b, p, [True, True, True, True, True])
    # '+m' is a partial value held by one rank; plain 'm' is replicated (nnScaler's rule)
    assert lay.inputs == ((Shard(1),), (Shard(0),), (Partial(),), (Replicate(),), None)
    assert lay.outputs == ((Partial(),), (Shard(0),))
    lay = op_layout(b, p, [True, True, False, False, False])
    assert lay.inputs[2] == (Replicate(),) and lay.outputs[0] == (Partial(),)


def test_mixed_split_and_replication_axis():
    b = bind(MATMUL, [(4, 4, 4), (4, 4, 4)])
    lay = op_layout(b, Partition.parse("m=2,k=2", 8))
    assert lay.inputs == ((Shard(1), Shard(2), Replicate()), (Replicate(), Shard(1), Replicate()))
    assert lay.outputs == ((Shard(1), Partial(), Replicate()),)
    assert op_layout(b, Partition.parse("replicate", 4)).outputs == ((Replicate(),),)
    assert op_layout(b, Partition.parse("replicate", 1)).outputs == ((),)


def test_group_layout():
    b = bind("(h d) s -> h s d", [(8, 3)], known={"h": 2})
    lay = op_layout(b, Partition.parse("h=2", 2))
    assert lay.inputs == ((Shard(0),),) and lay.outputs == ((Shard(0),),)


def test_layout_partial_inputs_length_checked():
    b = bind("m k+, k+ -> m", [(4, 4), (4,)])
    try:
        lay = op_layout(b, Partition.parse("k=2", 2), [False])
    except ValueError:
        return
    assert len(lay.inputs) == 2


@SETTINGS
@given(CASES, WORLDS, st.data())
def test_layouts_follow_the_annotation(case, world, data):
    anno, b, sizes, star_len = bound_case(case)
    p = data.draw(st.sampled_from(list(enumerate_partitions(b, world))), label="partition")
    floating = data.draw(st.lists(st.booleans(), min_size=len(anno.inputs), max_size=len(anno.inputs)))
    lay = op_layout(b, p, floating)

    def expected(t, partial_ok):
        dims = anno.expanded(t, star_len)
        if dims is None:
            return None
        out = []
        for ident in p.axis_ids:
            # in blocks of what precedes it in its merged dim ((3 d): 3; (b d): b's length)
            hits = [(d, math.prod(int(y) if y.isdigit() else sizes[y] for y in ids[:j]))
                    for d, ids in enumerate(dims) for j, x in enumerate(ids)
                    if x == ident and all(y.isdigit() or y in sizes for y in ids[:j])]
            if hits:
                out.append(Shard(*hits[0]))
            elif ident is not None and anno.markers.get(ident) == "+" and partial_ok:
                out.append(Partial())
            else:
                out.append(Replicate())
        return tuple(out)

    # an input lacking a split '+' identifier is V only when written '+x' (and floating), else R
    assert list(lay.inputs) == [expected(t, ok and pt.partial) for t, ok, pt in zip(anno.inputs, floating, b.anno.inputs)]
    assert list(lay.outputs) == [expected(t, True) for t in anno.outputs]


# --- rank meshes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("world", range(1, 17))
def test_mesh_shapes_are_all_ordered_factorisations(world):
    brute = {s for n in range(world.bit_length()) for s in itertools.product(range(2, world + 1), repeat=n)
             if math.prod(s) == world}
    shapes = mesh_shapes(world)
    assert len(shapes) == len(set(shapes)) and set(shapes) == brute


@pytest.mark.parametrize("shape", sorted({s for w in (1, 2, 4, 6, 8, 12) for s in mesh_shapes(w)}))
def test_coords_and_axis_groups(shape):
    world = math.prod(shape)
    strides = [math.prod(shape[a + 1:]) for a in range(len(shape))]
    all_coords = [coords(r, shape) for r in range(world)]
    assert sorted(all_coords) == list(itertools.product(*map(range, shape)))  # a bijection
    assert all(sum(c * s for c, s in zip(cs, strides)) == r for r, cs in enumerate(all_coords))  # row-major
    groups = axis_groups(shape)
    assert len(groups) == len(shape)
    for axis, gs in enumerate(groups):
        assert sorted(r for g in gs for r in g) == list(range(world))  # the groups partition the ranks
        for g in gs:
            assert len(g) == shape[axis]
            cs = [all_coords[r] for r in g]
            assert [c[axis] for c in cs] == list(range(shape[axis]))
            assert len({c[:axis] + c[axis + 1:] for c in cs}) == 1  # only this axis varies
