"""What each policy leaves replicated in a whole model, printed by ``verify model`` before it runs:
one line per policy and world size (see :mod:`nnscaler.policies.coverage`)."""
from __future__ import annotations

import warnings
from typing import Iterator, Sequence

import opzoo  # noqa: F401  (the annotations)
from nnscaler.policies import POLICIES, ComputeConfig
from nnscaler.policies.coverage import replicated_line
from nnscaler.trace.build import UnknownOperatorWarning, trace

from verify.models.loader import build_model
from verify.models.registry import ModelCase


def replicated_lines(name: str, policies: Sequence[str], world_sizes: Sequence[int], seed: int = 0,
                     case: ModelCase | None = None) -> Iterator[str]:
    """``model NAME, POLICY, W=n: k of m operators replicated: ...`` per policy and world size
    (``case``: the caller's inspection build of the model at ``seed``, else built here)."""
    try:
        case = build_model(name, seed) if case is None else case
        with warnings.catch_warnings():  # the lines below list them
            warnings.simplefilter("ignore", UnknownOperatorWarning)
            graph = trace(case.model, case.batch(0))
    except Exception as exc:  # the model cases report it as their error, with its traceback
        yield f"{name}: no plan to summarise ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return
    for policy in policies:
        for w in world_sizes:
            try:
                plan = POLICIES[policy](graph, ComputeConfig(w, tp_size=2 if w % 2 == 0 else 1, seed=seed))
            except Exception as exc:
                yield f"{name} {policy} W={w}: no plan ({type(exc).__name__}: {exc})"
                continue
            yield f"{name} {policy} W={w}: {replicated_line(graph, plan)}"
