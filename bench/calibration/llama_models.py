"""Llama-shaped and GPT-shaped models on the meta device (no weights allocated) for the cluster benchmarks, by
name; Llama shapes from the Llama 2 and Llama 3 model cards (hidden, ffn, layers, heads, kv heads, vocab), GPT
shapes (hidden, layers, heads, vocab; a GELU MLP of 4 x hidden, learned positions, untied head:
``verify.models.nanogpt``) from the published runs that used them (``nnscaler/cluster/published_runs.csv``: [SC21] the table-1 script of
Megatron-LM's SC'21 examples, [MC] Megatron-LM's README model table, [MPT] llm-foundry's benchmark tables)."""
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

GPT_SHAPES = {
    "gpt-sc21-1.7b": (2304, 24, 24, 51200), "gpt-sc21-3.6b": (3072, 30, 32, 51200),
    "gpt-sc21-7.5b": (4096, 36, 32, 51200), "gpt-sc21-18b": (6144, 40, 48, 51200),
    "gpt-sc21-39b": (8192, 48, 64, 51200), "gpt-sc21-76b": (10240, 60, 80, 51200),
    "gpt-sc21-145b": (12288, 80, 96, 51200), "gpt-sc21-310b": (16384, 96, 128, 51200),
    "gpt-sc21-530b": (20480, 105, 128, 51200), "gpt-sc21-1t": (25600, 128, 160, 51200),
    "gpt-mc-1.7b": (2048, 24, 16, 131072), "gpt-mc-7.1b": (4096, 30, 32, 131072),
    "gpt-mc-16b": (6144, 32, 48, 131072), "gpt-mc-32b": (7168, 48, 56, 131072),
    "gpt-mc-70b": (8192, 84, 64, 131072), "gpt-mc-119b": (10240, 92, 80, 131072),
    "gpt-mc-177b": (12288, 96, 96, 131072), "gpt-mc-314b": (16384, 96, 128, 131072),
    "gpt-mc-462b": (18432, 112, 144, 131072),
    # [MPT] MosaicML's MPT-7B and MPT-13B (d_model, n_layers, n_heads, vocab 50,368 of llm-foundry's yamls; the
    # benchmark table's NumParams at seq 2048, 6,658,859,008 and 12,853,954,560, is 12 L d^2 + (vocab + seq) d within
    # 0.03%: learned positions, like this GPT's)
    "gpt-mpt-7b": (4096, 32, 32, 50368), "gpt-mpt-13b": (5120, 40, 40, 50368),
}


def llama_model(name: str, seq: int):
    """``(model, ids)``: model ``name`` on meta (returning its loss) and one sample of ``seq`` tokens."""
    if name in GPT_SHAPES:
        from verify.models.nanogpt import GPT, GPTConfig
        hidden, layers, heads, vocab = GPT_SHAPES[name]
        with torch.device("meta"):
            return (GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden)),
                    torch.zeros(1, seq, dtype=torch.long))
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


CLUSTER_RUNS = (("llama3-8b", (8, 64)), ("llama3-70b", (64, 256, 1024)))  # (model, GPU counts) of bench/calibration/autodist.py's table
