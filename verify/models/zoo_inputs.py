"""Inputs a zoo text model needs besides its token ids and labels, derived from its forward's signature and
its config (``verify/models/zoo.py``): a captioning LM's loss assumes its image (GIT: ``pixel_values``), a
speech LM's encoder needs its audio (Voxtral-realtime: ``input_features``), an adapter model its language
(X-MOD: ``lang_ids``), a model that makes its own attention mask only when not compiled needs one
(LongT5, Switch Transformers: ``attention_mask``). Tried only when the model does not run on ids and labels alone
as ``torch.export`` runs it."""
from __future__ import annotations

import inspect
import itertools
from unittest import mock

import torch
import torch.nn as nn

Spec = tuple[tuple[int, ...], torch.dtype]  # an input's shape and dtype


def _sub(cfg, *names):
    """The first of ``cfg``'s sub-configs ``names`` it has, else ``cfg`` itself."""
    return next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), cfg)


def _candidates(name: str, cfg, batch: int, seq: int) -> list[Spec]:
    """The usual shapes of the input ``name`` for ``cfg``, most likely first."""
    if name == "pixel_values":
        sub = _sub(cfg, "vision_config")
        side = getattr(sub, "image_size", 32)
        side = side if isinstance(side, int) else 32
        return [((batch, getattr(sub, "num_channels", 3) or 3, side, side), torch.float32)]
    if name == "input_features":
        sub = _sub(cfg, "audio_config", "encoder_config")
        mel = getattr(sub, "num_mel_bins", None) or 16
        frames = 2 * (getattr(sub, "max_source_positions", None) or 32)
        return [((batch, mel, frames), torch.float32), ((batch, mel, 64), torch.float32),
                ((batch, mel, 16), torch.float32), ((batch, 64, mel), torch.float32)]
    if name == "lang_ids":  # the first of the config's languages
        return [((batch,), torch.long)]
    if name == "attention_mask":  # every token attended
        return [((batch, seq), torch.long)]
    return []


DERIVED = ("attention_mask", "pixel_values", "input_features", "lang_ids")


def _runs(model: nn.Module, given: dict, exported: bool = True) -> bool:
    """Whether ``model`` (a probe built apart from the case's model: whatever its forward writes, running statistics
    or RWKV's rescaled weights and ``layers_are_rescaled`` flag, never reaches the case) runs on ``given`` to a finite
    loss (or none), in eval mode; ``exported``: as under ``torch.export`` (``torch.compiler.is_compiling()`` true:
    transformers leaves out what it fills in eagerly)."""
    try:
        with torch.no_grad(), mock.patch.object(torch.compiler, "is_compiling", lambda: exported), \
                mock.patch.object(torch.compiler, "is_exporting", lambda: exported):
            out = model.eval()(**given)
        loss = getattr(out, "loss", None)
        return loss is None or bool(torch.isfinite(loss))
    except Exception:  # noqa: BLE001  (another candidate)
        return False


def extra_inputs(model: nn.Module, cfg, given: dict) -> dict[str, Spec]:
    """``{}`` if ``model`` runs on ``given`` (ids and labels) alone as exported; else the first set of its
    forward's :data:`DERIVED` inputs (one, then two, ...) with shapes of :func:`_candidates` it runs on;
    else ``{}`` if it runs eagerly (its trace says why not); ValueError naming what was tried if not even that."""
    if _runs(model, given):
        return {}
    params = inspect.signature(model.forward).parameters
    names = [n for n in DERIVED if n in params and n not in given]
    batch, seq = next(iter(given.values())).shape[:2]
    for k in range(1, len(names) + 1):
        for subset in itertools.combinations(names, k):
            for specs in itertools.product(*(_candidates(n, cfg, batch, seq) for n in subset)):
                extra = dict(zip(subset, specs))
                if _runs(model, {**given, **make(extra, torch.Generator().manual_seed(0))}):
                    return extra
    if _runs(model, given, exported=False):
        return {}
    raise ValueError(f"{type(model).__name__} does not run on {', '.join(given)}"
                     + (f" with any usual {', '.join(names)}" if names else ""))


def make(extra: dict[str, Spec], g: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors of ``extra``'s specs drawn from ``g`` (integers: the first choice, a mask: all ones)."""
    return {n: torch.randn(shape, generator=g) if dtype.is_floating_point
            else (torch.ones if n == "attention_mask" else torch.zeros)(shape, dtype=dtype) for n, (shape, dtype) in extra.items()}
