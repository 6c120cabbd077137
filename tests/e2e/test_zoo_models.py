"""``zoo:<model_type>``: any architecture of transformers' zoo (causal, masked, seq2seq LM, image and audio
classification), built from its config class's defaults shrunk, is a model the harness verifies; an
unknown type is one line and exit 2; ``verify all`` runs a sample of them (``--full``) and one cheap one
(the default)."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from verify.cli import main  # noqa: E402
from verify.judge.verdict import MATCH  # noqa: E402
from verify.models.loader import build_model, known_model  # noqa: E402
from verify.models.zoo import KINDS, kind_of  # noqa: E402
from verify.sweep.selection import ZOO, ZOO_DEFAULT, default_units, full_units  # noqa: E402

ONE_PER_KIND = {"causal": "llama", "masked": "albert", "seq2seq": "t5", "image": "vit", "speech": "wav2vec2"}


@pytest.mark.parametrize("kind, arch", ONE_PER_KIND.items())
def test_each_kind_builds_tiny_with_a_scalar_loss_and_a_batch_per_step(kind, arch):
    assert kind_of(arch) == kind and known_model(f"zoo:{arch}")
    a, b = build_model(f"zoo:{arch}", 0), build_model(f"zoo:{arch}", 0)
    assert sum(p.numel() for p in a.model.parameters()) < 500_000  # shrunk: few layers, small width
    for p, q in zip(a.model.parameters(), b.model.parameters()):  # the seed fixes the weights
        assert torch.equal(p, q)
    first, second = a.batch(0), a.batch(1)
    assert any(not torch.equal(x, y) for x, y in zip(first, second))  # each step its own batch
    with torch.no_grad():
        loss = a.model(*first)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert not any(m.p for m in a.model.modules() if isinstance(m, torch.nn.Dropout))  # no random stream to split


@pytest.mark.parametrize("name", ["zoo:no_such_model", "zoo:"])
def test_an_unknown_zoo_type_is_one_line_and_exit_2(name, capsys):
    assert main(["model", name, "--policy", "dp", "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no model type" in err[0], err


def test_verify_all_runs_the_zoo_sample_under_full_and_one_cheap_one_by_default():
    assert all(kind_of(a) for a in ZOO) and set(ZOO_DEFAULT) <= set(ZOO)
    assert {kind_of(a) for a in ZOO} == set(KINDS)  # every kind the sweep covers
    full = full_units(["relu"], ["nanogpt"], ["dp", "tp"], (2, 4), (0,), (0,), [1], [], False, zoo=ZOO)
    zoo = [u for u in full if u.name.startswith("zoo:")]
    assert {(u.name, u.policy) for u in zoo} == {(f"zoo:{a}", p) for a in ZOO for p in ("dp", "tp")}
    assert all(u.world_sizes == (2,) and not u.checkpoint for u in zoo)
    default = default_units(full, ["nanogpt"], ["dp", "tp"], (2, 4), (0,))
    assert {u.name for u in default if u.name.startswith("zoo:")} == {f"zoo:{a}" for a in ZOO_DEFAULT}
    assert not [u for u in full_units(["relu"], ["nanogpt"], ["dp"], (2,), (0,), (0,), [1], [], False)
                if u.name.startswith("zoo:")]  # only when asked


def test_a_vision_transformer_of_the_zoo_trains_like_one_device_under_dp_and_tp(verify_model):
    rows = verify_model("zoo:vit", policies=["dp", "tp"], world_sizes=(2,), steps=2)
    assert [r.status for r in rows] == [MATCH, MATCH]


@pytest.mark.parametrize("arch, kv_heads", [("llama", 2), ("mistral", 2), ("deepseek_v3", 4), ("minicpm3", 4)])
def test_shrunk_configs_keep_grouped_kv_heads_and_latent_attention_its_own(arch, kv_heads):
    """Causal LMs keep 2 kv heads of 4 (grouped-query attention is what the sweep measures); latent
    attention expands its keys and values per query head (kv heads = heads), and its head widths the
    config derives (``head_dim = qk_rope_head_dim``) follow their shrunk sources, so it runs."""
    case = build_model(f"zoo:{arch}", 0)
    cfg = case.model.model.config
    assert cfg.num_key_value_heads == kv_heads
    if hasattr(cfg, "qk_rope_head_dim") and hasattr(cfg, "qk_head_dim"):
        assert cfg.qk_head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    with torch.no_grad():
        assert torch.isfinite(case.model(*case.batch(0)))


@pytest.mark.parametrize("arch, extra", [("git", "pixel_values"), ("xmod", "lang_ids"), ("longt5", "attention_mask"),
                                         ("voxtral_realtime", "input_features"), ("gpt2", None)])
def test_a_text_model_gets_the_inputs_its_forward_needs_from_its_signature(arch, extra):
    """``verify/models/zoo_inputs.py``: a model that does not run on ids and labels alone as exported (GIT's loss
    assumes its image; LongT5 makes its mask only when not compiled) gets its forward's derived input; one that
    does gets none."""
    from verify.models.zoo import build
    from verify.models.zoo_inputs import _runs
    case = build(arch, 0)
    assert case.model.names == ("input_ids", "labels") + ((extra,) if extra else ()), case.model.names
    ids, labels, *rest = case.batch(0)
    assert _runs(case.model.model, {"input_ids": ids, "labels": labels}) == (extra is None)
    with torch.no_grad():
        assert torch.isfinite(case.model(*case.batch(1)))


def test_a_classifier_that_computes_no_loss_is_trained_on_the_cross_entropy_of_its_logits():
    from verify.models.zoo import build
    case = build("pp_lcnet", 0)
    x, labels = case.batch(0)
    with torch.no_grad():
        logits = case.model.model(pixel_values=x)[0]
        assert torch.equal(case.model(x, labels), torch.nn.functional.cross_entropy(logits, labels))


def test_the_builders_probe_writes_nothing_the_case_starts_from():
    """The probe that finds a text model's inputs runs a forward in eval mode; RWKV's eval forward divides its
    output weights in place and flags them rescaled, so its next training forward would write them back (a
    parameter write the compiler refuses). The probe runs on a copy: the built model is as constructed."""
    import transformers.models.rwkv.modeling_rwkv as R
    from nnscaler.trace.build import trace
    from verify.models.zoo import build
    case = build("rwkv", 0)
    rwkv = next(m for m in case.model.modules() if isinstance(m, R.RwkvModel))
    assert rwkv.training and not rwkv.layers_are_rescaled
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace(case.model, case.batch(0))  # no StateWriteError: the forward writes no parameter
