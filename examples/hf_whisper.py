"""transformers' Whisper, tiny (no download), as a ``verify model`` builder (issue 21):

    python -m verify model examples/hf_whisper.py:build --policy random tp --world-size 2 --dtype float64 --seed 0 1 2

With ``use_cache`` on (transformers' default) keys and values pass ``DynamicLayer.update``:
``torch.cat([torch.tensor([]), k], dim=-2)``, an operator with no annotation taking its tensors in a
list; before ``IROp.tensor_inputs`` read lists, random plans got conv1's gradient wrong (1.6e-4 at
seed 0, bound 9.6e-16) and tp's checkpoint resumed under random 1.3e-5. ``build_no_cache`` passes
``use_cache=False`` (no cache, no list: it matched before too)."""
import torch
import torch.nn as nn


class LossOf(nn.Module):
    def __init__(self, model: nn.Module, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, input_features, labels):
        return self.model(input_features=input_features, labels=labels, **self.kwargs).loss


def _build(seed: int, use_cache: bool):
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(seed)
    cfg = WhisperConfig(vocab_size=101, num_mel_bins=8, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        max_source_positions=8, max_target_positions=16, pad_token_id=0, decoder_start_token_id=1,
                        eos_token_id=2, bos_token_id=1, attn_implementation="eager", use_cache=use_cache,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = LossOf(WhisperForConditionalGeneration(cfg), **({} if use_cache else {"use_cache": False}))

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 * seed + step)
        return torch.randn(4, 8, 16, generator=g), torch.randint(3, 101, (4, 6), generator=g)
    return model, batch


def build(seed: int):
    return _build(seed, use_cache=True)


def build_no_cache(seed: int):
    return _build(seed, use_cache=False)
