"""Bad input: a model ``torch.export`` cannot trace gets the export error's first meaningful lines,
the model's own source line (not the wrapper's, not a graph dump) and what to change."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

from nnscaler.trace.build import trace
from nnscaler.trace.export import TraceError


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        n = int(y.abs().sum().item() ** 0.5)  # a size from the data (a branch on it traces: trace/branches.py)
        return y.sum() + torch.ones(n).sum()


class Wrapper(nn.Module):
    """A loss wrapper around the real model: the error must name the inner model's line."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_untraceable_model_names_its_line_and_the_fix(capfd):
    with pytest.raises(TraceError) as info:
        trace(Wrapper(Branchy()), (torch.randn(4, 8),))
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 800, msg
    assert msg.startswith("torch.export cannot trace Wrapper: GuardOnDataDependentSymNode: Could not")
    assert f"{__file__}:{_line_of(Branchy.forward, 'n = int(')} in forward: n = int(" in msg
    assert "to fix: " in msg and "torch.where" in msg
    err = capfd.readouterr().err
    assert "def forward(self" not in err, "the partial graph dump reached stderr"


def test_a_library_models_own_line_is_named_not_the_wrapper():
    pytest.importorskip("transformers")
    from transformers import MixtralConfig, MixtralForCausalLM
    from verify.models.common import LossOf
    cfg = MixtralConfig(vocab_size=97, hidden_size=48, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=3, num_key_value_heads=1, head_dim=16, num_local_experts=3,
                        num_experts_per_tok=2, experts_implementation="eager", use_cache=False,
                        attn_implementation="eager")
    ids = torch.randint(0, 97, (2, 8))
    from nnscaler.ops.registry import OpRegistry
    with pytest.raises(TraceError) as info:  # the eager experts loop over the experts a batch hits (a registry
        trace(LossOf(MixtralForCausalLM(cfg)), (ids, ids), registry=OpRegistry())  # without the MoE rewrite)
    msg = str(info.value)
    assert "modeling_mixtral.py:" in msg and "for expert_idx in expert_hit" in msg, msg
    assert "hf.py" not in msg
