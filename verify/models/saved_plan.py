"""A saved cluster plan (:mod:`nnscaler.cluster.plan`) at a size this machine runs.

:func:`reduce` keeps the plan's structure and shrinks its sizes:

* parallel degrees: each of tp, cp, pp, dp above 1 becomes 2 (an axis stays an axis, in the same order:
  tp innermost, then cp, dp, pipeline stages), or stays as planned (``as_planned``); where all four are
  above 1 (16 ranks), dp becomes 1 (:data:`REDUCED_WORLD`): its ranks run the same program on other rows
  of the batch, and the three axes whose programs differ are kept; cp's scheme and causal
  balance as planned (``verify plan`` refuses a cp scheme the compiler does not lower: ring, balanced chunks); the
  schedule, sequence parallelism, recompute, the ZeRO stage and the precision as planned; virtual stages as planned up
  to :data:`REDUCED_VIRTUAL` (2: an interleaved plan stays interleaved; the 405B plans' 8, with the micro-batches and
  layers they bring, ran out of this machine's memory);
* micro-batches: as many as planned up to two per pipeline stage (a multiple of pp under an
  interleaved schedule), each of at least the planned size up to 2 sequences per dp rank, more where
  the world size needs a batch it divides (the checkpoint is also reloaded under plain ``dp``);
* the model: the same ``transformers`` class and config with fewer layers (pp x virtual stages, at
  least 2), a small width (head dim 8), the same query-to-key/value-head ratio and feed-forward ratio,
  key/value heads = tp, a vocabulary 4x the width, sequences of 8 tokens. At these sizes the compiler's
  per-operator policy still splits every block's linears as the cost model costed them (Megatron's
  column/row pairs, vocabulary-parallel embedding and head): ``verify plan`` checks that before any
  rank starts (:func:`nnscaler.cluster.plan.check_lowering`); at head dim 4 it would not.

The reduced plan is written in the same file format (``reduced_from`` names the original), and a
plan file is a model reference of the harness (:func:`build_case`): ``verify model PLAN.json``
trains the model it describes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from nnscaler.config import PlanError
from nnscaler.cluster.cost import Parallel
from nnscaler.cluster.plan import FORMAT, SavedPlan, load, lowered_dict

from verify.models.common import LossOf, causal_lm
from verify.models.registry import ModelCase, tokens

REDUCED_DEGREE = 2
REDUCED_WORLD = 8  # the most ranks a reduced plan takes (this project's machines run 8); dp gives way first
REDUCED_VIRTUAL = 2  # the most virtual stages a reduced plan keeps (still interleaved where the plan is)
SEQ = 8
HEAD_DIM = 8
VOCAB_PER_HIDDEN = 4  # a vocabulary well above the width, as in real models (the head then splits by vocabulary)
MAX_PARAMS = 20_000_000  # a plan file whose model is larger is a real plan: verify its reduced model


def reduce_parallel(par: Parallel, as_planned: bool = False) -> Parallel:
    """``par`` with its degrees shrunk (see the module docstring) and micro-batches to match."""
    tp, cp, pp, dp = (d if as_planned else min(d, REDUCED_DEGREE) for d in (par.tp, par.cp, par.pp, par.dp))
    if not as_planned and tp * cp * pp * dp > REDUCED_WORLD:
        dp = 1  # the one axis whose ranks run the same program (see the module docstring)
    v = par.virtual_stages if as_planned else min(par.virtual_stages, REDUCED_VIRTUAL)
    m = min(par.num_microbatches, 2 * pp)
    if pp > 1:
        m = max(pp, -(-m // pp) * pp)
    world = tp * cp * pp * dp
    mbs = min(par.micro_batch_size, 2)
    mbs = math.lcm(dp * mbs, world) // dp  # the batch divides over every rank (the reload under dp)
    return dataclasses.replace(par, tp=tp, cp=cp, pp=pp, dp=dp, num_microbatches=m, micro_batch_size=mbs,
                               virtual_stages=v, zero=par.zero if dp * cp > 1 else 0)


def _hf_config(arch: dict):
    from transformers import AutoConfig
    cfg = dict(arch["config"])
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise PlanError("architecture.config lacks model_type")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as exc:
        raise PlanError(f"architecture: transformers cannot build a {model_type!r} config: {exc}") from None


def reduce_architecture(arch: dict, par: Parallel) -> dict:
    """``arch`` at the reduced size for the reduced ``par`` (see the module docstring)."""
    full = _hf_config(arch)
    heads = getattr(full, "num_attention_heads", None)
    hidden = getattr(full, "hidden_size", None)
    if not heads or not hidden:
        raise PlanError(f"architecture {arch['transformers']}: no num_attention_heads / hidden_size to reduce")
    kv = getattr(full, "num_key_value_heads", None) or heads
    if heads % kv:
        raise PlanError(f"architecture {arch['transformers']}: {heads} heads are not a multiple of {kv} kv heads")
    kv_r = par.tp if kv < heads else max(par.tp, 2)
    heads_r = heads // kv * kv_r
    hidden_r = heads_r * HEAD_DIM
    cfg = dict(arch["config"])
    cfg.update(hidden_size=hidden_r, num_attention_heads=heads_r, num_hidden_layers=max(2, par.pp * par.virtual_stages),
               vocab_size=VOCAB_PER_HIDDEN * hidden_r, max_position_embeddings=4 * SEQ)
    if "num_key_value_heads" in cfg or hasattr(full, "num_key_value_heads"):
        cfg["num_key_value_heads"] = kv_r
    if getattr(full, "head_dim", None):
        cfg["head_dim"] = HEAD_DIM
    ffn = getattr(full, "intermediate_size", None)
    if ffn:
        cfg["intermediate_size"] = max(1, round(ffn / hidden * hidden_r / par.tp)) * par.tp
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):  # inside the small vocabulary
        if isinstance(cfg.get(k), int):
            cfg[k] = 0
    return {**arch, "config": cfg}


def reduce(saved: SavedPlan, as_planned: bool = False) -> dict:
    """The reduced plan of ``saved`` as file data (the same format, ``reduced_from`` its path)."""
    if saved.architecture is None:
        raise PlanError(f"{saved.path}: the plan names no architecture to rebuild (only plans of transformers "
                        f"models, made by plan_cluster, carry one)")
    par = reduce_parallel(saved.parallel, as_planned)
    arch = reduce_architecture(saved.architecture, par)
    batch = par.dp * par.micro_batch_size * par.num_microbatches
    return {"format": FORMAT, "policy": "cluster", "model": saved.data.get("model", "model"),
            "world_size": par.world, "precision": saved.precision, "global_batch": batch, "seq": SEQ,
            "parallel": par.as_dict(), "architecture": arch, "lowered": lowered_dict(par, saved.precision),
            "reduced_from": str(saved.path), "planned": saved.data["parallel"]}


def write_reduced(saved: SavedPlan, directory: str | os.PathLike, as_planned: bool = False) -> Path:
    """Write :func:`reduce`'s plan into ``directory``; returns its path (a model reference)."""
    out = Path(directory) / f"{saved.path.stem}.reduced.json"
    out.write_text(json.dumps(reduce(saved, as_planned), indent=1) + "\n")
    return out


def is_plan_reference(ref: str) -> bool:
    """A model reference naming a plan file (``PATH.json``)."""
    return ref.endswith(".json")


def build_case(ref: str, seed: int) -> ModelCase:
    """The model a plan file describes, in its architecture and at its size, with batches of
    ``global_batch / num_microbatches`` sequences of the plan's ``seq`` tokens (one micro-batch
    of every dp rank; the harness stacks ``num_microbatches`` of them per step)."""
    import transformers
    saved = load(ref)
    arch = saved.architecture
    if arch is None:
        raise PlanError(f"{ref}: the plan names no architecture to build")
    cls = getattr(transformers, arch["transformers"], None)
    if not isinstance(cls, type):
        raise PlanError(f"{ref}: transformers has no model class {arch['transformers']!r}")
    cfg = _hf_config(arch)
    cfg._attn_implementation = arch.get("attn_implementation") or "eager"
    cfg.use_cache = False
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(cfg).parameters())
    if n > MAX_PARAMS:
        raise PlanError(f"{ref}: the plan's model has {n / 1e9:.1f} B parameters, too many to build here; "
                        f"verify its reduced model: python -m verify plan {ref}")
    torch.manual_seed(seed)
    model = LossOf(causal_lm(cls(cfg)))
    par = saved.parallel
    rows = par.dp * par.micro_batch_size
    vocab = cfg.vocab_size

    def batch(step: int):
        ids = tokens(vocab, (rows, saved.seq), 100 * seed + step)
        return ids, ids.clone()
    return ModelCase(model, batch)
