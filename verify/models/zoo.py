"""Any architecture of the pinned ``transformers`` as a model case, built from its config class's
defaults shrunk (few layers, small width, 4 heads, small images and clips; no download): the zoo
the sweep ``bench/studies/zoo.py`` measures, named ``zoo:<model_type>`` wherever a model name is taken::

    python -m verify model zoo:albert --policy dp tp --world-size 2

Five kinds, each with its loss and batch: causal LM, masked LM, seq2seq LM (token ids and labels),
image classification (pixels, class labels), speech (audio classification: a clip, class labels).
A model type in several kinds is built as the first of :data:`KINDS` that has it. ``build(arch,
kind="text")`` builds its sequence classifier instead (token ids, one class label per sequence: the
loss DeBERTa-v2 computes with ``if label_index.size(0) > 0:``), a kind the sweep does not run.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from verify.models.registry import ModelCase, tokens
from verify.models.zoo_inputs import extra_inputs, make

PREFIX = "zoo:"
BATCH, SEQ, LABELS, IMAGE, CLIP = 4, 8, 4, 32, 3200
MAX_PARAMS = 5_000_000  # a shrunk config past this is refused (sized on the meta device first, no memory)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, use_cache=False, tie_word_embeddings=False,
            # no dropout: a dropout with p > 0 stays unannotated on purpose (its random stream would follow the split)
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attention_dropout=0.0, dropout=0.0,
            activation_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            summary_first_dropout=0.0, classifier_dropout=0.0, ffn_dropout=0.0, embedding_dropout=0.0,
            # mixture of experts, state spaces, latent attention: small where a config has them
            num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            state_size=8, ssm_state_size=8, conv_kernel=4, expand=1, mamba_expand=1, mamba_d_state=8, mamba_n_heads=4,
            mamba_d_head=16, n_groups=1, time_step_rank=8)
"""The causal-LM overrides (``bench/studies/zoo_sweep.py``'s, kept so its tables stay comparable)."""

# config fields shrunk by name, whatever the kind (a field the config class lacks is not added)
LAYERS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
          "num_decoder_layers", "num_encoder_layers"}
WIDTH = {"hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 32, "embedding_size": 32,
         "intermediate_size": 128, "d_ff": 128, "ffn_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
         "n_inner": 128, "hidden_dim": 128, "d_kv": 16, "head_dim": 16, "classifier_proj_size": 32,
         "pooler_hidden_size": 64, "output_hidden_size": 64, "num_conv_pos_embeddings": 16,
         "num_conv_pos_embedding_groups": 4, "max_position_embeddings": 64, "max_source_positions": 64,
         "max_target_positions": 64, "image_size": IMAGE, "num_mel_bins": 16, "max_length": 64}
HEADS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads"}
# The same fields under an architecture's own prefix (``linear_num_heads``, ``mamba_chunk_size``,
# ``moe_shared_expert_intermediate_size``, ...): matched by the name's ending, so a field no list above
# names is still shrunk (an unshrunk 32 x 128 linear-attention width made kimi_linear 4.4 M parameters
# and ~1 GiB of activations per rank). (ending, its tiny value); the first ending that matches wins.
# State-space mixers keep heads x head width = expand x hidden: expand 1, 4 heads of 16 over width 64.
SUFFIXES = (("bottleneck_size", 32), ("num_key_value_heads", None), ("num_kv_heads", None), ("num_heads", 4), ("_n_heads", 4),
            ("head_dim", 16), ("headdim", 16), ("dim_head", 16), ("_d_head", 16), ("kv_channels", 16),
            ("intermediate_size", 128), ("ffn_hidden_size", 128), ("_ffn_dim", 128), ("d_inner", 128),
            ("dim_ff", 128), ("feed_forward_size", 128), ("hidden_size", 64), ("embedding_dim", 64), ("d_ssm", 64),
            ("lora_rank", 16), ("dt_rank", 8), ("rotary_dim", 8), ("chunk_size", SEQ), ("vocab_size", 128), ("_heads", 4))


def kinds():
    """(kind, the ``transformers`` auto class's name, its model-type -> class-name mapping) in
    :data:`KINDS`' order."""
    from transformers.models.auto import modeling_auto as m
    return [("causal", "AutoModelForCausalLM", m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
            ("masked", "AutoModelForMaskedLM", m.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
            ("seq2seq", "AutoModelForSeq2SeqLM", m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
            ("image", "AutoModelForImageClassification", m.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES),
            ("speech", "AutoModelForAudioClassification", m.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES)]


KINDS = ("causal", "masked", "seq2seq", "image", "speech")


def kind_of(arch: str) -> str | None:
    """The first kind whose auto class builds ``arch``, or None."""
    return next((k for k, _, names in kinds() if arch in names), None)


def archs_of(kind: str) -> list[str]:
    """The model types whose kind (:func:`kind_of`) is ``kind``, sorted."""
    names = dict((k, n) for k, _, n in kinds())[kind]
    return sorted(a for a in names if kind_of(a) == kind)


def shrunk(defaults: dict, kind: str, kv_heads: int | None) -> dict:
    """Overrides that make a config with these ``defaults`` tiny: layers 2, widths small, 4 heads
    (``kv_heads`` key/value heads), stage lists of vision models one block each, dropout, layer drop
    and spec-augment masks off (each is randomness a split would follow)."""
    out: dict = {}
    layers = None if "depths" in defaults else \
        next((v for k, v in defaults.items() if k in LAYERS and isinstance(v, int) and v > 2), None)  # (staged: per stage)
    for k, v in defaults.items():
        if isinstance(v, dict) and "model_type" in v:  # a nested model's config (encoder, decoder, text, audio)
            out[k] = {**v, **shrunk(v, kind, kv_heads)}
            continue
        if k == "attention_window":  # Longformer/LED pad the sequence to a window's multiple (512 by default)
            out[k] = [SEQ] * min(len(v), 2) if isinstance(v, list) else SEQ
            continue
        if isinstance(v, list) and layers and len(v) == layers and k not in LAYERS:  # one entry per layer
            out[k] = v[:2]
            continue
        if isinstance(v, dict) and layers and v and all(str(i).isdigit() for i in v):  # keyed by layer index
            out[k] = {i: ({**x, **shrunk(x, kind, kv_heads)} if isinstance(x, dict) else x)
                      for i, x in v.items() if int(i) < 2}
            continue
        if isinstance(v, bool) or k in ("id2label", "label2id") or k in ("hidden_size", "num_layers") and "depths" in defaults:
            continue  # (a staged vision model derives these from its stages)
        if isinstance(v, float) and ("drop" in k or k.startswith("mask_") and k.endswith("_prob")):
            out[k] = 0.0
        elif isinstance(v, int) and k in LAYERS:
            out[k] = min(v, 2)
        elif isinstance(v, int) and k in HEADS:
            out[k] = 4
        elif isinstance(v, int) and k in WIDTH:
            out[k] = min(v, WIDTH[k]) if v > 0 else v
        elif isinstance(v, int) and k == "num_key_value_heads" and kv_heads is not None:
            out[k] = kv_heads
        elif isinstance(v, int) and v > 0 and (tiny := _by_suffix(k, kv_heads)) is not None and v > tiny:
            out[k] = tiny
        elif isinstance(v, int) and k == "vocab_size":
            out[k] = 128
        elif isinstance(v, float) and k == "depth_multiplier":
            out[k] = min(v, 0.25)
        elif isinstance(v, int) and k == "patch_size":
            out[k] = min(v, 4)
        elif isinstance(v, int) and k == "window_size":
            out[k] = min(v, 2)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, int) for x in v):
            if k == "depths":
                out[k] = [1] * len(v)
            elif k in ("hidden_sizes", "embed_dims", "embed_dim", "neck_hidden_sizes"):
                out[k] = [16 * 2 ** i for i in range(len(v))]
            elif k == "num_heads":
                out[k] = [4] * len(v)
            elif k in ("conv_dim", "tdnn_dim"):
                out[k] = [32] * len(v)
    if "window_size" in out and "depths" in defaults:  # windows of 2 down to the last stage
        out["image_size"] = min(defaults.get("image_size", 224), 2 * out.get("patch_size", 4) * 2 ** (len(defaults["depths"]) - 1))
    if kind in ("causal", "masked", "seq2seq"):
        out.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False, tie_word_embeddings=False)
        if kind == "causal" and "is_decoder" in defaults:  # a causal LM is its config's decoder (reformer, bert-generation)
            out["is_decoder"] = True
        if kind == "seq2seq":
            out["decoder_start_token_id"] = 2
    else:
        out["num_labels"] = LABELS
        out["id2label"] = {i: f"LABEL_{i}" for i in range(LABELS)}  # consistent with num_labels (no warning)
    return out


def _by_suffix(key: str, kv_heads: int | None) -> int | None:
    """The tiny value of a field named by its ending (:data:`SUFFIXES`), or None."""
    for end, tiny in SUFFIXES:
        if key.endswith(end):
            return kv_heads if tiny is None else tiny
    return None


class NamedLoss(nn.Module):
    """``model(**dict(zip(names, args))).loss`` as a module of positional tensors; a model that computes
    no loss (a classifier whose forward takes no labels: PP-LCNet) gets the cross-entropy of its first
    output (its logits) against the ``labels``."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        given = dict(zip(self.names, args))
        out = self.model(**given)
        if getattr(out, "loss", None) is None and "labels" in given:
            return nn.functional.cross_entropy(out[0], given["labels"])
        return out.loss


TEXT = "text"  # sequence classification: built only when asked (``build(arch, kind=TEXT)``)


def build(arch: str, seed: int = 0, kv_heads: int | None = TINY["num_key_value_heads"], kind: str | None = None
          ) -> ModelCase:
    """``arch``'s tiny model of its kind (or of ``kind``: :data:`TEXT`), returning its loss, and the
    batch of each step."""
    import transformers
    from transformers import AutoConfig
    kind = kind or kind_of(arch)
    if kind is None:
        raise KeyError(f"{arch!r} is no model type of transformers' causal LM, masked LM, seq2seq, image or "
                       f"audio classification models")
    auto = getattr(transformers, dict((k, a) for k, a, _ in kinds())[kind] if kind != TEXT
                   else "AutoModelForSequenceClassification")
    defaults = AutoConfig.for_model(arch)
    over = shrunk(defaults.to_dict(), kind, kv_heads)
    if kind == TEXT:  # a text model's ids and a classifier's labels
        over.update(shrunk(defaults.to_dict(), "masked", kv_heads))
        over["label2id"] = {v: k for k, v in over["id2label"].items()}
    if kind == "causal":
        over.update({**TINY, "num_key_value_heads": kv_heads or TINY["num_key_value_heads"]})
    if "kv_lora_rank" in defaults.to_dict() and "num_key_value_heads" in over:  # latent attention expands its keys and
        over["num_key_value_heads"] = over.get("num_attention_heads", 4)  # values per query head: kv heads = heads
    # a field the config class derives (a property it refuses to set: xLSTM's v_head_dim, prophetnet's
    # num_hidden_layers) is left to it; a property it takes (num_labels) is set
    over = {k: v for k, v in over.items() if not isinstance(getattr(type(defaults), k, None), property)
            or _settable(defaults, k, v)}
    cfg = AutoConfig.for_model(arch, **_underived(arch, defaults, over))
    with torch.device("meta"):  # its size first: a config that ignores the shrinking is refused, not built
        n = sum(p.numel() for p in _construct(auto, cfg).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{arch}: {n} parameters after shrinking its config (over {MAX_PARAMS})")
    torch.manual_seed(seed)
    model = _construct(auto, cfg)
    if kind == "causal":
        model.loss_type = "ForCausalLM"  # transformers warns on each first loss of a process unless set
    vocab = getattr(cfg, "vocab_size", 128) or 128
    vocab = min(vocab, 128)
    if kind == TEXT:
        def batch(step: int):
            g = torch.Generator().manual_seed(100 * seed + step)
            return tokens(vocab - 3, (BATCH, SEQ), 100 * seed + step) + 3, torch.randint(0, LABELS, (BATCH,), generator=g)
        return ModelCase(NamedLoss(model.train(), ("input_ids", "labels")), batch)
    if kind in ("causal", "masked", "seq2seq"):
        def text(step: int):
            ids = tokens(vocab - 3, (BATCH, SEQ), 100 * seed + step) + 3
            labels = ids.clone() if kind != "seq2seq" else tokens(vocab - 3, (BATCH, SEQ), 100 * seed + step + 50) + 3
            if kind == "masked":  # predict every other position only
                labels[:, ::2] = -100
            return ids, labels
        # probed on a model built apart: what a probe's forward writes (RWKV's eval rescaling) stays off the case's
        extra = extra_inputs(_construct(auto, cfg), cfg, dict(zip(("input_ids", "labels"), text(0))))  # an image, audio, language

        def batch(step: int):
            return *text(step), *make(extra, torch.Generator().manual_seed(100 * seed + step + 70)).values()
        return ModelCase(NamedLoss(model.train(), ("input_ids", "labels", *extra)), batch)
    shape = _input_shape(_construct(auto, cfg), cfg, kind)  # probed on a model built apart, as above
    name = model.main_input_name

    def batch(step: int):
        g = torch.Generator().manual_seed(100 * seed + step)
        return torch.randn(shape, generator=g), torch.randint(0, LABELS, (BATCH,), generator=g)
    return ModelCase(NamedLoss(model.train(), (name, "labels")), batch)


def _underived(arch: str, defaults, over: dict) -> dict:
    """``over`` less the fields the config class computes from others in its ``__init__`` (DeepSeek's
    ``head_dim = qk_rope_head_dim`` and ``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``): a
    field that is no parameter of ``__init__`` and moves when only the others are shrunk follows
    them (shrunk on its own, it contradicted them: 10 latent-attention models failed to trace)."""
    import inspect

    from transformers import AutoConfig
    params = inspect.signature(type(defaults).__init__).parameters
    if all(k in params for k in over):
        return over
    probe = AutoConfig.for_model(arch, **{k: v for k, v in over.items() if k in params})
    return {k: v for k, v in over.items() if k in params or getattr(probe, k, None) == getattr(defaults, k, None)}


def _settable(cfg, key: str, value) -> bool:
    """Whether the config property ``key`` takes ``value`` (tried on a copy)."""
    import copy

    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the probe's own complaints (num_labels vs id2label) are not the user's
    try:
        setattr(copy.deepcopy(cfg), key, value)
        return True
    except Exception:  # noqa: BLE001  (no setter, or one that refuses: NotImplementedError, ValueError)
        return False
    finally:
        hf_logging.set_verbosity(level)


def _construct(auto, cfg) -> nn.Module:
    try:
        return auto.from_config(cfg, attn_implementation="eager")
    except (ValueError, ImportError):  # a model with no eager attention: its default
        return auto.from_config(cfg)


def _input_shape(model: nn.Module, cfg, kind: str) -> tuple[int, ...]:
    """The input of an image or speech model: the first of the usual shapes its forward takes."""
    if kind == "image":
        side = getattr(cfg, "image_size", IMAGE)
        side = side if isinstance(side, int) else IMAGE
        cands = [(BATCH, getattr(cfg, "num_channels", 3), side, side)]
    else:
        mel = getattr(cfg, "num_mel_bins", 16)
        cands = [(BATCH, CLIP), (BATCH, getattr(cfg, "max_length", 64), mel),
                 (BATCH, mel, 2 * getattr(cfg, "max_source_positions", 32)),
                 (BATCH, 32, getattr(cfg, "feature_size", mel))]
    errors = []
    for shape in cands:
        try:
            with torch.no_grad():
                model(**{model.main_input_name: torch.randn(shape), "labels": torch.zeros(BATCH, dtype=torch.long)})
            return shape
        except Exception as exc:  # noqa: BLE001  (the next usual shape)
            errors.append(f"{shape}: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}")
    raise ValueError(f"no usual input shape fits {type(model).__name__}: " + "; ".join(errors))


def is_zoo(ref: str) -> bool:
    return ref.startswith(PREFIX)


def zoo_builder(ref: str):
    """The builder ``seed -> ModelCase`` of ``zoo:<model_type>``; KeyError for an unknown type."""
    arch = ref[len(PREFIX):]
    if kind_of(arch) is None:
        raise KeyError(f"model {ref!r}: {arch!r} is no model type of transformers' causal LM, masked LM, seq2seq, "
                       f"image or audio classification models")

    def builder(seed: int) -> ModelCase:
        return build(arch, seed)
    builder.__name__ = ref
    return builder
