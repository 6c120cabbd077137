"""Models shaped for tensor parallelism, for the ``tp`` tests and benchmarks: head counts (query and
key/value) and widths divisible by the world sizes 2 and 4, dropout 0, any number of layers.
GPT-2's LM head is untied here: its tied form (``hf.py``'s ``gpt2``) matches under ``tp`` too, but at
this width its tied-weight gradient sits at the harness's float32 tolerance (1.05e-6 vs 9.84e-7
at seed 0, error that ``dp`` shows at other seeds too).
(``hf.py`` keeps deliberately awkward shapes: there heads cannot be split at W=2.)"""
from __future__ import annotations

import torch

from verify.models.builders import EncoderRegression
from verify.models.common import LossOf, MaskedLossOf, causal_lm, lm_batch
from verify.models.nanogpt import GPT, GPTConfig
from verify.models.registry import ModelCase, register_model, tokens

VOCAB = 128


def nanogpt(layers: int = 2, width: int = 64, heads: int = 4, seed: int = 0) -> ModelCase:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=layers, n_head=heads, n_embd=width)
    return ModelCase(GPT(cfg), lambda step: (tokens(VOCAB, (4, 8), 2 * step + seed),
                                             tokens(VOCAB, (4, 8), 2 * step + 1 + seed)))


def gpt2(layers: int = 2, width: int = 64, heads: int = 4, seed: int = 0) -> ModelCase:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=heads, n_positions=32, attn_pdrop=0.0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager", use_cache=False,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    return ModelCase(LossOf(causal_lm(GPT2LMHeadModel(cfg))), lm_batch(VOCAB, seed))


def llama(layers: int = 2, width: int = 64, heads: int = 4, seed: int = 0) -> ModelCase:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=32,
                      attn_implementation="eager", use_cache=False)
    return ModelCase(LossOf(LlamaForCausalLM(cfg)), lm_batch(VOCAB, seed))


def bert(layers: int = 2, width: int = 64, heads: int = 4, seed: int = 0) -> ModelCase:
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * width, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     max_position_embeddings=32, attn_implementation="eager")
    return ModelCase(MaskedLossOf(BertForMaskedLM(cfg)), lm_batch(VOCAB, seed, masked=True))


class T5Loss(torch.nn.Module):
    """T5 without labels (decoder inputs given): the mean of its logits' log-softmax at the ids."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        logits = self.model(input_ids=input_ids, decoder_input_ids=labels, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def t5(layers: int = 2, width: int = 64, heads: int = 4, seed: int = 0) -> ModelCase:
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=VOCAB, d_model=width, d_kv=width // heads, d_ff=2 * width, num_layers=layers,
                   num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0, use_cache=False,
                   decoder_start_token_id=0, pad_token_id=0)
    return ModelCase(T5Loss(T5ForConditionalGeneration(cfg)), lm_batch(VOCAB, seed))


def transformer_encoder(layers: int = 2, width: int = 64, heads: int = 4, seed: int = 0) -> ModelCase:
    """``torch.nn.TransformerEncoder``: ``nn.MultiheadAttention``'s packed projection and heads merged
    into the batch (the tracer keeps the heads apart, ``nnscaler/trace/heads.py``)."""
    torch.manual_seed(seed)

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 + step + seed)
        return torch.randn(4, 8, width, generator=g), torch.randn(4, 8, width, generator=g)
    return ModelCase(EncoderRegression(width, heads, layers), batch)


TP_MODELS = {"nanogpt": nanogpt, "gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5,
             "transformer_encoder": transformer_encoder}


def _register() -> None:
    """``tp_nanogpt``, ``tp_gpt2``, ... for ``python -m verify model`` (two layers, width 32, 4 heads)."""
    for name, build in TP_MODELS.items():
        register_model(f"tp_{name}")(lambda seed, build=build: build(width=32, seed=seed))


_register()
