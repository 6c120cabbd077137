"""A parallelized module's parameters under the model's own names, read as torch's state-dict code
reads them (``torch.distributed.checkpoint.state_dict``): the prefixes wrappers insert into every name
below them are dropped, ``checkpoint_wrapper``'s ``_checkpoint_wrapped_module.`` (activation
checkpointing as torchtitan applies it) and ``torch.compile``'s ``_orig_mod.``. torch's own reader of
these (``_get_fqns``) is private and walks one name at a time, so the two prefixes are dropped here."""
from __future__ import annotations

from typing import Iterator

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

try:  # the prefix as torch spells it, where this torch has it
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX as CHECKPOINTED
except ImportError:  # pragma: no cover
    CHECKPOINTED = "_checkpoint_wrapped_module."
COMPILED = "_orig_mod."


def model_name(name: str) -> str:
    """``name`` as the unwrapped model spells it."""
    return name.replace(CHECKPOINTED, "").replace(COMPILED, "")


def named_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``module.named_parameters()`` under the model's own names (:func:`model_name`)."""
    for name, p in module.named_parameters():
        yield model_name(name), p


def model_state_dict(module: torch.nn.Module) -> tuple[dict, str | None]:
    """The module's state to checkpoint: ``get_model_state_dict``'s, or, where that raises (state-dict hooks
    that rename keys, as torchtitan's fused QKV does: torch maps each key back to a parameter and fails),
    ``module.state_dict()`` itself, as the model's own hooks write it, with a note saying so. Collective."""
    try:
        return get_model_state_dict(module), None
    except Exception as exc:  # noqa: BLE001 - any failure of torch's reader: the model's own state dict is saved
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return module.state_dict(), (f"model saved and loaded through model.state_dict() and load_state_dict() "
                                     f"(its state-dict hooks; get_model_state_dict raised {type(exc).__name__}: "
                                     f"{first})")
