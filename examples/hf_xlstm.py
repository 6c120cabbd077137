"""transformers' xLSTM (``xLSTMForCausalLM``), tiny (no download), as a ``verify model`` builder (issue 21):

    python -m verify model examples/hf_xlstm.py:build --policy random tp --world-size 2 --dtype float32 --seed 0 1 2

Its default ``mode="inference"`` joins the recurrence's chunks with ``torch.concatenate`` (no
annotation, its tensors in a list); before ``IROp.tensor_inputs`` read lists, random plans got the
embedding's gradient wrong (7.6e-2 at seed 2 in float32). xLSTM keeps its recurrent state and its
norms' reductions in float32 whatever the run's dtype; a float64 run is judged against a reference
that promotes those islands, with a floor of float32 ulps (``verify/judge/compare.py``)."""
import torch

from verify.models.common import LossOf


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
