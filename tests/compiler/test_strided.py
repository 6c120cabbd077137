"""``as_strided`` of a transposed view (Longformer's and LED's sliding chunks, ``tests/fixtures/strided_chunks.py``):
read through a contiguous copy in the storage's order (``nnscaler/trace/strided.py``), the program's result no
longer depends on the layout it holds the view in (a gathered tensor is contiguous; one device's is transposed),
and it matches one device on ranks under dp and tp."""
from __future__ import annotations

import tempfile

import pytest
import torch

import opzoo  # noqa: F401
from nnscaler.trace.strided import dense_as_strided
from tests.conftest import FIXTURES
from tests.fixtures.strided_chunks import build

aten = torch.ops.aten


def _uncopied(graph):
    """The weaker rewrite: the view permuted into its storage's order, but not copied."""
    n = dense_as_strided(graph)
    for node in list(graph.nodes):
        if node.target is aten.clone.default and getattr(node.args[0], "target", None) is aten.permute.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    return n


def _relaid(graph):
    """The transposed view held as a contiguous copy, as a program that gathered it holds it."""
    for node in list(graph.nodes):
        if node.target is aten.transpose.int:
            with graph.inserting_after(node):
                copy = graph.call_function(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
            node.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)


@pytest.mark.parametrize("rewrite,equal", [(dense_as_strided, True), (_uncopied, False), (lambda graph: 0, False)])
def test_the_rewritten_read_does_not_depend_on_the_views_layout(rewrite, equal):
    model, batch = build(0)
    x = batch(0)
    want = model(*x)
    ep = torch.export.export(model, x, strict=False)
    assert rewrite(ep.graph) == (0 if rewrite.__name__ == "<lambda>" else 1)
    _relaid(ep.graph)
    ep.graph_module.recompile()
    assert torch.equal(ep.module()(*x), want) == equal


def test_strided_chunks_match_one_device_under_dp_and_tp():
    from verify.config import RunConfig
    from verify.judge.verdict import MATCH
    from verify.rows.run import run_model
    from verify.runner.gang import Gang
    with Gang(2, (), (2,)) as gang, tempfile.TemporaryDirectory() as tmp:
        rows = list(run_model(gang, f"{FIXTURES / 'strided_chunks.py'}:build", ("dp", "tp"), RunConfig(world_sizes=(2,)),
                              tmp, steps=2))
    assert [r.status for r in rows] == [MATCH, MATCH], [(r.status, r.detail) for r in rows]
