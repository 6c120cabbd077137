"""The built-in model builders say nothing: a transformers config whose token ids lie outside its
vocabulary makes transformers log a warning per build, and a model whose class names no loss (GPT-2)
one at its first loss, per rank and per case, which flooded `verify all`."""
from __future__ import annotations

import logging
import warnings

import pytest

pytest.importorskip("transformers")

import verify.models.hf  # noqa: E402,F401  (registers the transformers models)
import verify.models.hf_more  # noqa: E402,F401
from verify.models.registry import MODELS  # noqa: E402


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize("name", ["gpt2", "phi3", "gpt2_v96", "tp_gpt2", "llama", "bert"])
def test_builder_is_quiet(name, capfd):
    handler = _Records()
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            case = MODELS[name](0)
            case.model(*case.batch(0))
    finally:
        root.removeHandler(handler)
    out, err = capfd.readouterr()
    said = [r.getMessage() for r in handler.records] + [str(w.message) for w in seen]
    assert not said and "[transformers]" not in out + err, (said, err[-2000:])
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING
    for m in case.model.modules():  # what decides the loss warning (said once per process, so checked too)
        if isinstance(m, PreTrainedModel) and m.__class__.__name__.endswith(("LMHeadModel", "ForCausalLM")):
            assert getattr(m, "loss_type", None) in LOSS_MAPPING, (name, type(m).__name__)
