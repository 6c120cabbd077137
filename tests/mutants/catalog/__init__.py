"""The mutants: name -> a function that monkeypatches one small bug into the compiler or runtime,
one module per family (``collectives``, ``grad_sync``, ``module``, ``plans``, ``conversions``,
``microbatch``, ``context``, ``frees``, ``ring``; the registry and :func:`patch` in ``_base``). Each is applied on import of a shim
``--module`` file (see ``run.py``), in the parent and in every rank, before anything is compiled. Each
is meant to change results on some built-in model and plan; one that survives the full ``verify all``
is either a blind spot of the harness or a path no built-in model reaches (say so in the runner's report).

Other processes load this package by path, under a name of their own: give the spec the folder
(``spec_from_file_location(name, dir / "__init__.py", submodule_search_locations=[dir])``) and put
the module into ``sys.modules`` before running it, so the families' relative imports find it."""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Iterator

# each family registers its mutants on import, in this order (the runner's default order)
from . import collectives, grad_sync, module, plans, conversions, microbatch, context, frees, ring  # noqa: F401,I001
from ._base import MUTANTS, apply, mutant, patch  # noqa: F401

# -- applying a mutant for one case only (tests on a shared rank gang) --------------------------------
PATCHED_MODULES = ("nnscaler.runtime.collectives", "nnscaler.runtime.grad_sync", "nnscaler.runtime.microbatch",
                   "nnscaler.runtime.grad_steps",
                   "nnscaler.runtime.module", "nnscaler.runtime.mesh", "nnscaler.codegen.emit",
                   "nnscaler.dimops.partition", "opzoo.kernels", "nnscaler.checkpoint.pipeline",
                   "nnscaler.checkpoint.layout", "nnscaler.checkpoint.format", "nnscaler.checkpoint.sharded",
                   "nnscaler.runtime.ring", "nnscaler.comm.conversion")


@contextmanager
def applied(name: str) -> Iterator[None]:
    """Mutant ``name`` applied inside the block only: every attribute of :data:`PATCHED_MODULES` and of
    the classes they define is put back afterwards, so a rank gang shared with other tests stays clean."""
    targets = []
    for m in map(importlib.import_module, PATCHED_MODULES):
        targets += [m, *(v for v in vars(m).values() if isinstance(v, type) and v.__module__ == m.__name__)]
    saved = [(t, dict(vars(t))) for t in targets]
    apply(name)
    try:
        yield
    finally:
        for t, before in saved:
            now = vars(t)
            for k in [k for k in now if k not in before]:
                delattr(t, k)
            for k, v in before.items():
                if now.get(k) is not v:
                    setattr(t, k, v)
        from opzoo.rulekit import rederive_examples  # the examples as the restored rules derive them
        rederive_examples()
