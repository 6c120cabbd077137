"""The harness's one way to compile a case's program: ``parallelize`` as a case needs it."""
from __future__ import annotations

import contextlib
import inspect
import io
import sys
import warnings

import torch.distributed as dist

from nnscaler import PlanWarning, parallelize
from nnscaler.trace.build import UnknownOperatorWarning


def compile_case(model, args, policy, config, groups, gen_dir, tracer=None, announce: bool = True):
    """``parallelize(..., verify=False)``: the case verifies the whole program itself, so operator
    verdicts add nothing; unknown operators are replicated without a warning (the row lists them).
    The case's own plan (``announce``) prints its one-line summary and its :class:`PlanWarning` s, once
    each on rank 0, as one line naming the model's code (:func:`plan_warning_line`); every reload,
    resume and localisation compile of it prints neither again."""
    quiet = contextlib.nullcontext() if announce else contextlib.redirect_stdout(io.StringIO())
    with warnings.catch_warnings(record=True) as caught, quiet:
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        warnings.simplefilter("always", PlanWarning)  # collected here, said below
        pm = parallelize(model, args, policy, config, groups=groups, gen_savedir=gen_dir, tracer=tracer,
                         verify=False)
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    said = set()
    for w in caught:
        if not issubclass(w.category, PlanWarning):  # anything else: as the caller's filters say
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        elif announce and first and str(w.message) not in said:
            said.add(str(w.message))
            print(plan_warning_line(model, w.message), file=sys.stderr, flush=True)
    return pm


def plan_warning_line(model, message) -> str:
    """``FILE:LINE: PlanWarning: ...`` at the model's class, the user's code the plan was made for
    (not the harness line that compiled it)."""
    cls = type(model)
    try:
        where = f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):  # a class without source (built in C, made at run time)
        where = f"{cls.__module__}.{cls.__qualname__}"
    return f"{where}: {type(message).__name__}: {message}"
