"""The user's file of the torchtitan matrix (``bench/studies/titan_matrix.py``): torchtitan 0.3's own Llama 3
debug model (shrunk for CPU: 4 layers, dim 64, 4 heads, vocabulary 128, torchtitan's causal SDPA) and one
parallelization per recipe, each calling torchtitan's own ``parallelize_llama`` (or ``pipeline_llm`` where the
mesh has ``pp``) with its own ``ParallelDims``, ``ParallelismConfig`` and activation-checkpointing config. The
degrees come from the mesh the harness lays (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp``); the recipe from the
function's name: ``par`` (no activation checkpointing) or ``par_ac`` (torchtitan's ``FullAC``), ``_<schedule>``
for pipelines (``par_1F1B``, ``par_ac_Interleaved1F1B``). ``build_sp`` declares sequence parallelism.

    python -m verify model bench/studies/titan_user.py:build_sp --parallelize bench/studies/titan_user.py:par \\
        --mesh dp_shard=2,tp=2 --world-size 4
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from torchtitan.components.loss import cross_entropy_loss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.distributed.context_parallel import prepare_context_parallel_input
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import _build_llama3_layers, parallelize_llama
from torchtitan.models.llama3.model import Llama3Model

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 128, 64, 4, 4, 8, 8
BACKEND = "partial_dtensor"  # parameters as DTensors: torch 2.13's fully_shard refuses the default backend's
TP = 2  # the tensor-parallel degree the model's sharding declarations are made for


class LM(nn.Module):
    """torchtitan's model and its loss (the sum over tokens over their count: the mean). Under context
    parallelism (``cp_mesh`` set by the parallelization) each step's tokens, labels and positions are first cut
    to this rank's chunks by torchtitan's own ``prepare_context_parallel_input``, as its trainer does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.cp_mesh = None

    def forward(self, tokens, labels):
        kwargs = {}
        if self.cp_mesh is not None:
            positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
            tokens, labels, kwargs = prepare_context_parallel_input(tokens, labels, {"positions": positions},
                                                                    self.cp_mesh, tokens.device)
        return cross_entropy_loss(self.model(tokens, **kwargs), labels) / labels.numel()


def llama_config(sp: bool, layers: int = LAYERS) -> Llama3Model.Config:
    """torchtitan's Llama 3 debug model config, shrunk, its sharding declared for ``TP`` (with or without sequence
    parallelism)."""
    init = {"weight": lambda w: nn.init.trunc_normal_(w, std=0.02), "bias": nn.init.zeros_}
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init={"weight": nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
        layers=_build_llama3_layers(n_layers=layers, dim=DIM, n_heads=HEADS, hidden_dim=4 * DIM,
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000),
                                    attn_backend="flex"))
    for layer in config.layers:  # torchtitan's causal SDPA (FlexAttention has no CPU backward)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.update_from_config(config=SimpleNamespace(parallelism=ParallelismConfig(
        tensor_parallel_degree=TP, enable_sequence_parallel=sp, spmd_backend=BACKEND)))
    return config


def qwen3_config(sp: bool, ep: int = 2, layers: int = LAYERS) -> "Qwen3Model.Config":
    """torchtitan's Qwen3-MoE debug model, shrunk: 4 experts of width 32, top 2, 2 key/value heads."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model
    init = {"weight": lambda w: nn.init.normal_(w, std=0.02), "bias": nn.init.zeros_}
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
        layers=_build_qwen3_moe_layers(n_layers=layers, dim=DIM, n_heads=HEADS, n_kv_heads=2, head_dim=16,
                                       moe_hidden_dim=32, num_experts=4, top_k=2, attn_backend="flex",
                                       moe_comm_backend="standard",
                                       rope=CosSinRoPE.Config(dim=16, max_seq_len=64, theta=1000000.0)))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.update_from_config(config=SimpleNamespace(parallelism=ParallelismConfig(
        tensor_parallel_degree=1, expert_parallel_degree=ep, spmd_backend=BACKEND)))  # as torchtitan's own MoE config
    return config


def build_qwen3(seed):
    """torchtitan's Qwen3-MoE debug model (``parallelize_qwen3``'s), shrunk."""
    return build_lm(seed, lambda: qwen3_config(False))


def build_lm(seed: int, config, batch_size: int = BATCH):
    """``(LM, batch)`` of the model ``config()`` makes, seeded, and its token batches of ``batch_size`` rows."""
    torch.manual_seed(seed)
    model = config().build()
    with torch.no_grad():
        model.init_states()

    def batch(step):
        g = torch.Generator().manual_seed(100 * seed + step)
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return LM(model), batch


def build(seed):
    """The debug model without sequence parallelism in its sharding declarations."""
    return build_lm(seed, lambda: llama_config(False))


def build_sp(seed):
    """The same model declaring sequence parallelism."""
    return build_lm(seed, lambda: llama_config(True))


def _parallelism(mesh, schedule: str | None = None, moe: bool = False) -> tuple[ParallelismConfig, dict]:
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    ep = sizes.get("dp_shard", 1) * sizes.get("tp", 1) if moe else 1  # EP borrows the dp_shard x tp ranks
    return ParallelismConfig(expert_parallel_degree=ep,data_parallel_replicate_degree=sizes.get("dp_replicate", 1),
                             data_parallel_shard_degree=sizes.get("dp_shard", 1),
                             tensor_parallel_degree=sizes.get("tp", 1), context_parallel_degree=sizes.get("cp", 1),
                             enable_sequence_parallel=sizes.get("tp", 1) > 1,
                             pipeline_parallel_degree=sizes.get("pp", 1),
                             pipeline_parallel_schedule=schedule or "1F1B",
                             pipeline_parallel_microbatch_size=1, spmd_backend=BACKEND), sizes


def _apply(lm: LM, mesh, ac: bool, schedule: str | None, moe: bool = False):
    from torchtitan.models.qwen3 import parallelize_qwen3
    parallelism, sizes = _parallelism(mesh, schedule, moe)
    parallelize = parallelize_qwen3 if moe else parallelize_llama
    set_spmd_backend(BACKEND)
    dims = ParallelDims.from_config(parallelism, world_size=mesh.size())
    training = TrainingConfig(mixed_precision_param="float32")
    ac_config = FullAC.Config() if ac else None
    if sizes.get("cp", 1) > 1:
        lm.cp_mesh = dims.get_mesh("cp")
    if "pp" not in sizes:
        parallelize(lm.model, parallel_dims=dims, training=training, parallelism=parallelism,
                    compile_config=CompileConfig(), ac_config=ac_config, dump_folder="")
        return lm
    dp = sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1)
    local = BATCH // dp
    n_mb = local  # micro-batches of 1 row

    def loss_fn(pred, labels):  # the sum over tokens over the global batch's tokens (torchtitan's global-token rescale)
        return cross_entropy_loss(pred, labels) / (labels.numel() * n_mb * dp), None

    return pipeline_llm(lm.model, parallel_dims=dims,
                        training=TrainingConfig(local_batch_size=local, seq_len=SEQ, mixed_precision_param="float32"),
                        parallelism=parallelism, compile_config=CompileConfig(), ac_config=ac_config, dump_folder="",
                        device=torch.device("cpu"),
                        model_config=(qwen3_config(False, parallelism.expert_parallel_degree) if moe
                                      else llama_config(sizes.get("tp", 1) > 1)),
                        parallelize_fn=parallelize, loss_fn=loss_fn)


def __getattr__(name: str):
    """``par``, ``par_ac``, ``par_<schedule>``, ``par_ac_<schedule>``: torchtitan's parallelization as the mesh
    says, with or without activation checkpointing, with that pipeline schedule; ``moe_par...``: the same by
    ``parallelize_qwen3``, experts over the dp_shard x tp ranks."""
    moe = name.startswith("moe_")
    base = name[len("moe_"):] if moe else name
    if not base.startswith("par"):
        raise AttributeError(name)
    rest = base[len("par"):].lstrip("_")
    ac = rest == "ac" or rest.startswith("ac_")
    schedule = rest[3:] if rest.startswith("ac_") else (rest if rest and rest != "ac" else None)

    def fn(lm, mesh):
        return _apply(lm, mesh, ac, schedule, moe)
    fn.__name__ = name
    return fn
