"""``torch.utils.checkpoint`` inside a user's model, honoured. ``torch.export`` runs the checkpointed
function once and records its operators like any others, so a program generated from the trace alone
would keep every activation (silently saving nothing). :func:`watch_checkpoints` numbers each call
(reentrant or not) made while the model is traced and annotates the operators it runs with that number
(``torch.fx.traceback.annotate``, kept in each node's ``meta["custom"]`` under :data:`KEY`); the
operators of one call become one recompute region of the generated program (``IROp.checkpoint``,
:mod:`nnscaler.codegen.recompute`), run through ``torch.utils.checkpoint`` (non-reentrant) as the model
asked, so the program saves what the single-device model saves and computes what it computes.

A reentrant call (``use_reentrant=True``) is refused (:func:`refusal`): ``torch.export`` inlines its
autograd function and records its forward under ``no_grad``, so the traced program loses the gradient
path through it; and its semantics differ (no parameter gradients where no input requires grad)."""
from __future__ import annotations

import contextlib
import traceback
from pathlib import Path
from typing import Iterator

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as tuc

REENTRANT = "reentrant: "  # the mark of a use_reentrant=True call in ``calls``
KEY = "nnscaler_checkpoint"  # node.meta["custom"][KEY]: the number of the hand checkpoint call it ran in
_OURS = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))


def _caller() -> str:
    """``file:line: code`` of the innermost frame outside torch and nnscaler (the model's call)."""
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(_OURS)
              and "/functools.py" not in f.filename]
    if not frames:
        return "an unknown line"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


@contextlib.contextmanager
def watch_checkpoints(calls: list[str]) -> Iterator[None]:
    """Append the model's line of every ``torch.utils.checkpoint`` call made inside to ``calls``, and
    annotate the operators the call runs with its index there (the calls still run; nested calls
    number their own operators)."""
    gen, fn = tuc._checkpoint_without_reentrant_generator, tuc.CheckpointFunction

    def generator(*args, **kwargs):
        calls.append(_caller())
        inner = gen(*args, **kwargs)
        next(inner)
        with fx_traceback.annotate({KEY: len(calls) - 1}):
            yield
        next(inner, None)

    class Reentrant:
        @staticmethod
        def apply(*args):
            calls.append(REENTRANT + _caller())
            return fn.apply(*args)

    tuc._checkpoint_without_reentrant_generator, tuc.CheckpointFunction = generator, Reentrant
    try:
        with fx_traceback.preserve_node_meta():  # annotations reach the exported nodes
            yield
    finally:
        tuc._checkpoint_without_reentrant_generator, tuc.CheckpointFunction = gen, fn


def checkpoint_of(node: torch.fx.Node) -> int | None:
    """The hand checkpoint call ``node`` ran in (:func:`watch_checkpoints`), or None."""
    custom = node.meta.get("custom") or {}
    return custom.get(KEY)


def refusal(model: torch.nn.Module, calls: list[str]) -> str:
    """The one-line error for a model making a reentrant ``torch.utils.checkpoint`` call (empty: none)."""
    reentrant = [c[len(REENTRANT):] for c in calls if c.startswith(REENTRANT)]
    if not reentrant:
        return ""
    more = f" (and {len(reentrant) - 1} more)" if len(reentrant) > 1 else ""
    return (f"{type(model).__name__} calls torch.utils.checkpoint(..., use_reentrant=True) at {reentrant[0]}{more}, "
            f"which torch.export traces under no_grad (the program would lose its gradients); pass "
            f"use_reentrant=False (recomputed in the generated program as in the model), or remove it and compile "
            f"with ComputeConfig(recompute='full') or recompute='selective'")
