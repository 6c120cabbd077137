"""The rule families that keep users' models data parallel: a key/value cache's ``cat`` of a 1-d
empty start, ``concatenate``, ``roll``, transposed convolutions, ``var``/``std``, fused
``rnn``/``gru``/``lstm``, ``max``/``min``/``arg*``/``amax``, ``tril``/``triu``, ``scatter``,
``repeat``, ``reshape_as``. Each derives the expected annotation, its examples match on real ranks
under every partition, and a deliberately wrong variant of it (``tests/fixtures/wrong_rule_families.py``)
mismatches exactly where its mistake is split; models using them plan with no operator kept whole."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import opzoo  # noqa: F401
from nnscaler import DEFAULT_REGISTRY
from opzoo.rulekit import EXAMPLES, T, derive, make_call
from tests.conftest import FIXTURES, split_ids
from verify.config import RunConfig
from verify.judge.verdict import MATCH, MISMATCH
from verify.runner.gang import Gang
from verify.rows.run import run_op

WRONG_FILE = str(FIXTURES / "wrong_rule_families.py")
NEW = ["aten.cat.default", "aten.concatenate.default", "aten.roll.default", "aten.conv_transpose1d.default",
       "aten.conv_transpose2d.input", "aten.conv_transpose3d.input", "aten.var.dim", "aten.var.correction",
       "aten.std.correction", "aten.std.dim", "aten.gru.input", "aten.lstm.input", "aten.rnn_tanh.input",
       "aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.amax.default", "aten.tril.default",
       "aten.triu.default", "aten.scatter.value", "aten.scatter.src", "aten.repeat.default",
       "aten.reshape_as.default", "aten.view_as.default", "aten.view_as_complex.default",
       "aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.max_pool1d.default", "aten.max_pool2d.default",
       "aten.adaptive_avg_pool1d.default", "aten.adaptive_avg_pool2d.default", "aten.einsum.default",
       "aten.view_as_real.default", "aten.gather.default", "aten.index_select.default", "aten.index.Tensor",
       "aten.index_put.default"]


@pytest.mark.parametrize("overload, args, annotation", [
    ("aten.cat.default", ([T(0), T(4, 2, 8, 16)], -2), "0, a b e^ d, ? -> a b c^ d"),  # the KV cache's first step
    ("aten.concatenate.default", ([T(4, 2, 4, 16), T(4, 2, 4, 16)], 2), "a b e^ d, a b f^ d, ? -> a b c^ d"),
    ("aten.roll.default", (T(2, 6, 6, 8), [3, -3], [1, 2]), "a b^ c^ d, ?, ? -> a b^ c^ d"),
    ("aten.conv_transpose2d.input", (T(2, 8, 4, 4), T(8, 3, 2, 2), T(12), [2, 2], [0, 0], [0, 0], 4),
     "n (g 2) a^ b^, (g 2) 3 c^ d^, (g 3), ?, ?, ?, ? -> n (g 3) e^ f^"),
    ("aten.var.correction", (T(4, 8, 6), [1]), "a b^ c, ? -> a c"),
    ("aten.gru.input", (T(5, 4, 6), T(2, 4, 8), [T(24, 6), T(24, 8), T(24, 6), T(24, 8)], False, 1, 0.0, True,
                        True, False), "d^ b e^, a^ b c^, f^ g^, h^ i^, j^ k^, l^ m^, ?, ?, ?, ?, ?, ? -> n^ b o^, p^ b q^"),
    ("aten.max.dim", (T(4, 4, 8, 8), -1, True), "a b c d^, ?, ? -> a b c 1, a b c 1"),
    ("aten.tril.default", (T(4, 2, 6, 6), -1), "a b c^ d^, ? -> a b c^ d^"),
    ("aten.repeat.default", (T(4, 6), [2, 1, 3]), "a b, ? -> 2 a (3 b)"),
    ("aten.adaptive_avg_pool2d.default", (T(4, 6, 8, 8), [1, 1]), "n c a^ b^, ? -> n c 1 1"),
    ("aten.conv2d.default", (T(4, 1, 8, 8), T(6, 1, 3, 3), T(6)), "n 1 a^ b^, o 1 c^ d^, o -> n o e^ f^"),
    # einsum: a letter per identifier, contracted ones split by value; ``...`` and implicit outputs spelled out
    ("aten.einsum.default", ("bind,bjnd->bnij", [T(2, 8, 4, 6), T(2, 8, 4, 6)]), "?, a b c d+, a e c d+ -> a c b e"),
    ("aten.einsum.default", ("...ij,...jk->...ik", [T(2, 4, 8, 6), T(4, 6, 5)]), "?, a b c d+, b d+ e -> a b c e"),
    ("aten.einsum.default", ("ij,jk", [T(4, 6), T(6, 5)]), "?, a b+, b+ c -> a c"),
    ("aten.einsum.default", ("bij,xjk->bik", [T(2, 8, 6), T(1, 6, 5)]), "?, a b c+, 1 c+ d -> a b d"),
])
def test_derived_annotation(overload, args, annotation):
    assert derive(make_call(overload, args)).annotation == annotation


def test_every_new_family_has_verified_examples():
    for overload in NEW:
        assert EXAMPLES.get(overload), f"no example registered for {overload}"
        for name in EXAMPLES[overload]:
            assert DEFAULT_REGISTRY.get(name).family == "rules"


def test_rules_decline_what_they_cannot_split():
    # dropout between the layers of a recurrent stack: its random stream would follow the split
    gru = make_call("aten.gru.input", (T(4, 5, 6), T(2, 4, 8), [T(24, 6), T(24, 8), T(24, 8), T(24, 8)], False, 2,
                                       0.5, True, False, True))
    assert derive(gru) is None
    assert derive(make_call("aten.scatter.value", (T(8, 4), 1, T(4, 1, dtype=torch.int64), 1.0))) is None  # short index
    assert derive(make_call("aten.einsum.default", ("ii->i", [T(6, 6)]))) is None  # a diagonal: no split of i


@pytest.fixture(scope="module")
def wrong_gang():
    """Two ranks that import the wrong variants (their own gang: the variants have their own names,
    but a shared gang's ranks would not know them)."""
    with Gang(2, [WRONG_FILE], (2,)) as g:
        yield g



def test_right_examples_match_and_wrong_variants_are_caught(wrong_gang):
    """Every example of the new families matches under every partition at W=2; each wrong variant
    mismatches under every partition that splits its mistake, and matches under the others."""
    from tests.fixtures.wrong_rule_families import WRONG  # registers the variants here too
    gang = wrong_gang
    cfg = RunConfig(world_sizes=(2,), seeds=(0,))
    for overload in NEW:
        for name in EXAMPLES[overload]:
            for row in run_op(gang, DEFAULT_REGISTRY.get(name), cfg):
                assert row.status == MATCH, (name, row.partition, row.status, row.detail)
    for name, culprit in WRONG.items():
        rows = list(run_op(gang, DEFAULT_REGISTRY.get(name), cfg))
        culprits = {culprit} if isinstance(culprit, str) else set(culprit)
        caught = [r for r in rows if culprits & split_ids(r.partition)]
        assert caught, f"{name}: no partition splits {culprit}"
        for row in rows:
            expected = MISMATCH if row in caught else MATCH
            assert row.status == expected, (name, row.partition, row.status, row.detail)


class UNetish(nn.Module):
    """A transposed convolution, a shifted window (``roll``), a GRU and an LSTM over the batch."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1)
        self.gru = nn.GRU(16, 12, batch_first=True, num_layers=2)
        self.lstm = nn.LSTM(12, 6, batch_first=True)

    def forward(self, x):
        h = torch.roll(self.up(torch.relu(self.down(x))), shifts=(1, -1), dims=(2, 3))  # (b, 4, 8, 8)
        seq = h.flatten(2).transpose(1, 2).reshape(x.shape[0], 16, 16)
        out, _ = self.gru(seq)
        out, _ = self.lstm(out)
        return (out.var(dim=-1).mean(-1) + out.amax(dim=(1, 2))).mean()  # per sample, then the batch mean


def _dp_plan(model, args):
    from nnscaler.compile.plan import plan_graph, trace_model
    from nnscaler.config import ComputeConfig
    from nnscaler.policies.coverage import replicated_operators
    from nnscaler.policies.tp_check import collectives
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace_model(model, args, None, registry=None, strict=False)
    plan = plan_graph(graph, "dp", ComputeConfig(2))
    return replicated_operators(graph, plan), sum(collectives(graph, plan, params=False)[0].values())


def test_a_model_using_the_families_plans_data_parallel():
    """No operator kept whole under ``dp``: one forward collective (the loss)."""
    assert _dp_plan(UNetish(), (torch.randn(4, 3, 8, 8),)) == ([], 1)


@pytest.mark.parametrize("name", ["speech_encdec", "xlstm_tiny"])
def test_builtin_recurrent_and_cached_models_plan_data_parallel(name):
    """The key/value cache's ``cat`` of an empty start (speech_encdec: 7 forward collectives before),
    ``concatenate`` and ``var`` (xlstm_tiny: 5 before) no longer keep operators whole."""
    from verify.models.registry import MODELS
    case = MODELS[name](0)
    assert _dp_plan(case.model, case.batch(0)) == ([], 1)


def unetish(seed: int):
    """``UNetish`` as a whole model: ``build(seed) -> (model, batch_fn)``."""
    torch.manual_seed(seed)
    return UNetish(), lambda step: (torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(10 * seed + step)),)


def test_a_model_using_the_families_trains_like_on_one_device(verify_model):
    """On the ranks: the transposed convolution, the shifted window and the GRU/LSTM under dp and tp."""
    rows = verify_model(unetish, policies=["dp", "tp"], world_sizes=(2,), steps=2)
    assert len(rows) == 2


def test_recurrent_layers_draw_random_numbers_only_with_dropout():
    """``aten.gru.input`` is tagged as drawing random numbers; it does only with a dropout between
    layers in training (the weights spread into the inputs of the annotated op must not be read as
    that probability)."""
    from nnscaler.trace.build import trace
    for dropout, expected in ((0.0, False), (0.5, True)):
        torch.manual_seed(0)
        gru = nn.GRU(8, 8, num_layers=2, dropout=dropout, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = trace(gru, (torch.randn(4, 5, 8),))
        (op,) = [o for o in graph.ops if o.overload == "aten.gru.input"]
        assert op.known is not expected  # the rule declines a dropout between layers
        assert op.draws_random is expected
