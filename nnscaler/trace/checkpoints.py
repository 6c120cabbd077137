"""``torch.utils.checkpoint`` inside a user's model: ``torch.export`` runs the checkpointed function
once and records its operators like any others, so the compiled program would keep every activation
(silently saving nothing). :func:`watch_checkpoints` notes each such call while the model is traced;
``export_model`` then refuses the model with one line naming the call and the built-in option,
``ComputeConfig(recompute=...)``, which recomputes in the generated program."""
from __future__ import annotations

import contextlib
import traceback
from pathlib import Path
from typing import Iterator

import torch
import torch.utils.checkpoint as tuc

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
    """Append the model's line of every ``torch.utils.checkpoint`` call (reentrant or not) made inside
    to ``calls``; the calls still run (the trace is unchanged)."""
    gen, fn = tuc._checkpoint_without_reentrant_generator, tuc.CheckpointFunction

    def generator(*args, **kwargs):
        calls.append(_caller())
        return gen(*args, **kwargs)

    class Reentrant:
        @staticmethod
        def apply(*args):
            calls.append(_caller())
            return fn.apply(*args)

    tuc._checkpoint_without_reentrant_generator, tuc.CheckpointFunction = generator, Reentrant
    try:
        yield
    finally:
        tuc._checkpoint_without_reentrant_generator, tuc.CheckpointFunction = gen, fn


def refusal(model: torch.nn.Module, calls: list[str]) -> str:
    """The one-line error for a model that calls ``torch.utils.checkpoint`` (empty: it does not)."""
    if not calls:
        return ""
    more = f" (and {len(calls) - 1} more call{'s' if len(calls) > 2 else ''})" if len(calls) > 1 else ""
    return (f"{type(model).__name__} calls torch.utils.checkpoint at {calls[0]}{more}, which tracing removes (the "
            f"compiled program would keep every activation); remove it and compile with "
            f"ComputeConfig(recompute='full') (each block, or recompute_modules=(...) to name them) or "
            f"recompute='selective' (the attention core), which recompute in the generated program")
