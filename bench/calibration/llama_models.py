"""Llama-shaped models on the meta device (no weights allocated) for the cluster benchmarks, by name;
shapes from the Llama 2 and Llama 3 model cards (hidden, ffn, layers, heads, kv heads, vocab)."""
from __future__ import annotations

import warnings

import torch

SHAPES = {
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
    "llama3-70b": (8192, 28672, 80, 64, 8, 128256),
    "llama3-405b": (16384, 53248, 126, 128, 8, 128256),
    "llama2-13b": (5120, 13824, 40, 40, 40, 32000),
    "llama2-70b": (8192, 28672, 80, 64, 8, 32000),
}


def llama_model(name: str, seq: int):
    """``(model, ids)``: model ``name`` on meta (returning its loss) and one sample of ``seq`` tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verify.models.common import LossOf
    hidden, ffn, layers, heads, kv, vocab = SHAPES[name]
    with torch.device("meta"):
        model = LossOf(LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                                    num_hidden_layers=layers, num_attention_heads=heads,
                                                    num_key_value_heads=kv, max_position_embeddings=seq,
                                                    attn_implementation="sdpa", use_cache=False)))
        ids = torch.zeros(1, seq, dtype=torch.long)
    return model, ids


def llama_architecture(name: str, seq: int) -> dict:
    """What a saved cluster plan of model ``name`` records to rebuild it (``nnscaler.cluster.plan.architecture_of``)."""
    from nnscaler.cluster.plan import architecture_of
    return architecture_of(llama_model(name, seq)[0])


def llama_shape(name: str, seq: int):
    """The :class:`~nnscaler.cluster.blocks.ModelShape` of model ``name`` traced once on meta at ``seq``."""
    import opzoo  # noqa: F401  (registers the operator annotations)

    from nnscaler.cluster.search import trace_shape
    model, ids = llama_model(name, seq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_shape(model, (ids, ids))
