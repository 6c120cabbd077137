"""The harness's one way to compile a case's program: ``parallelize`` as a case needs it."""
from __future__ import annotations

import contextlib
import io
import warnings

from nnscaler import parallelize
from nnscaler.trace.build import UnknownOperatorWarning


def compile_case(model, args, policy, config, groups, gen_dir, tracer=None, announce: bool = True):
    """``parallelize(..., verify=False)``: the case verifies the whole program itself, so operator
    verdicts add nothing; unknown operators are replicated without a warning (the row lists them);
    the plan's one-line summary is printed for the case's own plan only (``announce``), not again for
    every reload, resume or localisation compile."""
    quiet = contextlib.nullcontext() if announce else contextlib.redirect_stdout(io.StringIO())
    with warnings.catch_warnings(), quiet:
        warnings.simplefilter("ignore", UnknownOperatorWarning)
        return parallelize(model, args, policy, config, groups=groups, gen_savedir=gen_dir, tracer=tracer,
                           verify=False)
