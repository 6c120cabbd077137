"""The harness mutant catalogue: each a small fail-open change to ``verify/`` (or to a layout conversion's
backward) that would let a wrong program pass or a case go unjudged, registered with the pytest node ids of
the tests that kill it. Families: ``judge`` (comparison rules and bounds, verdict, resume, localisation),
``sweep`` (selection, cache key, shard, merge), ``plans`` (the reduced plan), ``cases`` (spread samples,
torch parallelizations, blocked layouts' backward), ``precision`` (the recipe's precision checked
structurally), ``kinks`` (near-kink values explained, the reference following the run's side), ``truth``
(what a row says: non-finite references, step-0 notes, widened bounds, files imported once, reports at
other settings, the dtype conversion), ``pipeline`` (users' pipelines: stage layout, the micro-batch loss, tensors
from the stage that holds them, the pp dimension). ``tests/mutants/harness_run.py`` runs each mutant's
killing tests with it applied (``--harness-mutant NAME``, ``tests/mutants/harness_plugin.py``)."""
from __future__ import annotations

from . import judge, sweep, plans, cases, precision, kinks, truth, pipeline  # noqa: F401,I001  (each family registers on import)
from ._base import HARNESS, Mutant, applied, apply, undo  # noqa: F401
