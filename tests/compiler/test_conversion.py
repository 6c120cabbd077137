"""Layout conversions on 2-D and 3-D meshes: every step legal under the nesting convention, and every
conversion, run on real ranks, yields the right piece of the whole tensor forward and of the whole
gradient backward (property tests over random layouts, including one dim split on two axes)."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnscaler.comm.conversion import Step, conversion, layout_steps
from nnscaler.dimops.layout import Partial, Replicate, Shard, layout_str
from verify.cases.conversion import parse_layout

# meshes of the 4-rank session gang: 1-D, 2-D and 3-D with a degenerate axis
MESHES_4 = [(4,), (2, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2)]


def feasible(layout, mesh, shape) -> bool:
    """Every split dim divides by the product of the axes (and blocks) splitting it; a split in
    blocks is its dim's only split."""
    for d, n in enumerate(shape):
        on = [(m, q) for m, q in zip(mesh, layout) if isinstance(q, Shard) and q.dim == d and m > 1]
        f = math.prod(m * q.blocks for m, q in on)
        if n % f or (len(on) > 1 and any(q.blocks > 1 for _, q in on)):
            return False
    return True


@st.composite
def cases(draw, meshes=MESHES_4, blocks=False):
    """A conversion job; with ``blocks``, shards may split one factor of a fused dim (``D1/3``)."""
    mesh = draw(st.sampled_from(meshes))
    ndim = draw(st.integers(1, 3))
    lengths = [12, 6, 24, 4] if blocks else [4, 8, 2, 6]
    shape = tuple(draw(st.sampled_from(lengths)) for _ in range(ndim))
    shard = st.builds(Shard, st.integers(0, ndim - 1), st.sampled_from([1, 2, 3]) if blocks else st.just(1))
    placement = st.one_of(st.just(Replicate()), st.just(Partial()), shard)
    layout = st.tuples(*[placement for _ in mesh]).filter(lambda lay: feasible(lay, mesh, shape))
    src = draw(layout)
    dst = draw(layout)
    ids = tuple(draw(st.sampled_from([None, "i"])) if isinstance(q, Replicate) else None for q in dst)
    grad = draw(st.booleans())
    if not grad:  # an integer tensor has no partial values downstream of a consumer
        ids = tuple(None for _ in dst)
    return {"kind": "conversion", "mesh": list(mesh), "shape": list(shape), "src": layout_str(src),
            "dst": layout_str(dst), "ids": list(ids), "grad": grad, "seed": draw(st.integers(0, 2**16))}


def run_on_ranks(gang, job) -> list[dict]:
    answers = gang.run(job, math.prod(job["mesh"]), timeout_s=60)
    out = []
    for a in answers:
        assert a.failure is None, f"{job}: {a.failure}"
        assert "error" not in a.result, f"{job}: {a.result['error']}\n{a.result.get('traceback', '')}"
        out.append(a.result)
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=cases())
def test_every_conversion_gives_the_right_pieces_forward_and_backward(gang, job):
    for r in run_on_ranks(gang, job):
        assert r["problems"] == [], f"{job} via {r['steps']}: {r['problems']}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=cases(blocks=True))
def test_conversions_with_splits_in_blocks_give_the_right_pieces(gang, job):
    """Shards of one factor of a fused dim (reached as the target, left by an all-gather) on 1-D to
    3-D meshes, and ``all_gather_sum_grad`` where a gather feeds split work."""
    for r in run_on_ranks(gang, job):
        assert r["problems"] == [], f"{job} via {r['steps']}: {r['problems']}"


@pytest.mark.parametrize("src,dst,mesh,shape", [
    ("D0xD1", "D1xD0", (2, 2), (4, 4)),      # the conversion issue 13 found wrong
    ("D1xD1", "D0xD0", (2, 2), (4, 4)),      # one dim on two axes, nested, to another
    ("D0xD0", "D0xR", (2, 2), (4, 2)),       # gather the inner split only
    ("RxD0", "D0xD0", (2, 2), (8, 2)),       # the outer split after the inner one
    ("VxD1xD1", "D1xD1xR", (2, 2, 1), (2, 4)),
    ("D0xD1xD2", "D2xD0xD1", (2, 1, 2), (2, 2, 2)),
    ("D1xR", "RxD1/3", (2, 2), (2, 12)),      # a contiguous split is not the blocks a fused consumer wants
    ("VxD0", "D1/3xD0", (2, 2), (4, 12)),     # reduce-scatter into blocks
    ("D1/3xD0", "D1xD1", (2, 2), (4, 12)),    # blocks left by an all-gather only
])
def test_named_conversions_on_ranks(gang, src, dst, mesh, shape):
    job = {"kind": "conversion", "mesh": list(mesh), "shape": list(shape), "src": src, "dst": dst,
           "ids": [None] * len(mesh), "grad": True, "seed": 7}
    for r in run_on_ranks(gang, job):
        assert r["problems"] == [], f"{src} -> {dst} via {r['steps']}: {r['problems']}"


def _apply(step: Step, layout):
    """The layout after ``step``, asserting the step is legal under the nesting convention."""
    lay = list(layout)
    p = lay[step.axis]
    inner = [q for q in lay[step.axis + 1:] if isinstance(q, Shard)]
    if step.kind in ("all_gather", "all_gather_sum_grad", "all_to_all"):
        assert isinstance(p, Shard) and p.dim == step.dims[0]
        assert all(q.dim != p.dim for q in inner), f"{step} gathers an outer split of dim {p.dim}"
        assert step.blocks == p.blocks and (p.blocks == 1 or step.kind != "all_to_all")
    if step.kind in ("split", "reduce_scatter", "all_to_all"):
        d = step.dims[-1]
        assert all(q.dim != d for q in inner), f"{step} splits dim {d} inside a finer split"
        others = [q for a, q in enumerate(lay) if a != step.axis and isinstance(q, Shard) and q.dim == d]
        assert not (others and (step.blocks > 1 or any(q.blocks > 1 for q in others))), \
            f"{step}: a split in blocks must be its dim's only split"
    new = {"split": Shard(step.dims[-1], step.blocks) if step.dims else None, "all_gather": Replicate(),
           "all_gather_sum_grad": Replicate(),
           "all_reduce": Replicate(), "reduce_scatter": Shard(step.dims[-1], step.blocks) if step.dims else None,
           "all_to_all": Shard(step.dims[-1]) if step.dims else None, "to_partial": Partial(),
           "grad_all_reduce": p}[step.kind]
    lay[step.axis] = new
    return tuple(lay)


@settings(max_examples=200, deadline=None)
@given(job=st.one_of(cases(meshes=MESHES_4 + [(2, 2, 2), (2, 4), (4, 2), (3, 2)]),
                     cases(meshes=MESHES_4 + [(2, 2, 2), (2, 4), (4, 2), (3, 2)], blocks=True)))
def test_every_step_is_legal_and_the_path_ends_at_the_target(job):
    src, dst, mesh = parse_layout(job["src"]), parse_layout(job["dst"]), tuple(job["mesh"])
    steps, cost = conversion(src, dst, job["ids"], mesh, tuple(job["shape"]), job["grad"])
    lay = tuple(Replicate() if f == 1 else q for f, q in zip(mesh, src))
    for step in steps:
        lay = _apply(step, lay)
        assert feasible(lay, mesh, job["shape"]), f"{step} splits a dim unevenly"
    # on an axis of one rank every placement is the whole tensor
    assert lay == tuple(Replicate() if f == 1 else q for f, q in zip(mesh, dst))
    free = {"to_partial"} if job["grad"] else {"to_partial", "split"}  # a forward split is local
    assert cost >= 0 and (cost == 0) == all(s.kind in free for s in steps)


def test_the_per_axis_order_bug_is_gone():
    """D0xD1 -> D1xD0 must never split dim 1 on axis 0 while axis 1 still splits it."""
    steps, _ = layout_steps((Shard(0), Shard(1)), (Shard(1), Shard(0)), (2, 2), 2, (4, 4), True)
    lay = (Shard(0), Shard(1))
    for step in steps:
        lay = _apply(step, lay)
    assert lay == (Shard(1), Shard(0))


def test_an_impossible_target_is_refused_loudly():
    with pytest.raises(ValueError, match="not divisible"):
        conversion((Replicate(), Replicate()), (Shard(0), Shard(0)), (None, None), (2, 2), (2, 3), True)


def test_cost_is_in_bytes_and_scales_with_the_local_share():
    """Gathering a quarter costs less than gathering a half: the cost counts the bytes each step moves."""
    _, outer = conversion((Shard(0), Replicate()), (Replicate(), Replicate()), (None, None), (2, 2), (4, 4), False)
    _, both = conversion((Shard(0), Shard(1)), (Replicate(), Shard(1)), (None, None), (2, 2), (4, 4), False)
    assert outer == pytest.approx(0.5) and both == pytest.approx(0.25)
