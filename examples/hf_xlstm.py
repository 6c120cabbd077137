"""transformers' xLSTM (``xLSTMForCausalLM``), tiny (no download), as a ``verify model`` builder (issue 21):

    python -m verify model examples/hf_xlstm.py:build --policy random tp --world-size 2 --dtype float32 --seed 0 1 2

Its default ``mode="inference"`` joins the recurrence's chunks with ``torch.concatenate`` (no
annotation, its tensors in a list); before ``IROp.tensor_inputs`` read lists, random plans got the
embedding's gradient wrong (7.6e-2 at seed 2 in float32). A float64 run is no float64 program:
xLSTM keeps its recurrent state and its norms' reductions in float32 (``inference_state_dtype``,
``norm_reduction_force_float32``), so every policy, ``dp`` included, differs from one device by
float32 rounding (~3e-8) against a float64 bound (~1e-15)."""
import torch
import torch.nn as nn


class LossOf(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build(seed: int):
    from transformers import xLSTMConfig, xLSTMForCausalLM
    torch.manual_seed(seed)
    cfg = xLSTMConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_heads=4, chunk_size=4,
                      ffn_round_up_to_multiple_of=16, use_cache=False)
    model = LossOf(xLSTMForCausalLM(cfg))

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 * seed + step)
        return torch.randint(0, 101, (4, 8), generator=g), torch.randint(0, 101, (4, 8), generator=g)
    return model, batch
