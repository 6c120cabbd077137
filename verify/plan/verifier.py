"""The harness as the compiler's plan verifier: :class:`HarnessVerifier` answers the
:class:`nnscaler.Verifier` protocol and is installed under the ``nnscaler.verifiers`` entry point, so
``parallelize(verify=...)`` and ``plan_model(verify=...)`` run it without the compiler importing it."""
from __future__ import annotations

import os

from nnscaler.ir.graph import IRGraph
from nnscaler.ir.plan import Plan
from nnscaler.runtime.mesh import GroupCache

from verify.plan.check import PairVerdict, cached_verdicts, verify_plan
from verify.plan.offline import verify_offline


class HarnessVerifier:
    """Verdicts from the cache, from the ranks of the caller's process group, or from a local gang."""

    def cached(self, graph: IRGraph, plan: Plan, cache_path: str | os.PathLike | None) -> list[PairVerdict] | None:
        return cached_verdicts(graph, plan, cache_path)

    def on_ranks(self, graph: IRGraph, plan: Plan, *, groups: GroupCache, rank: int,
                 cache_path: str | os.PathLike | None, group) -> list[PairVerdict]:
        return verify_plan(graph, plan, groups=groups, rank=rank, cache_path=cache_path, group=group)

    def offline(self, graph: IRGraph, plan: Plan, cache_path: str | os.PathLike | None) -> list[PairVerdict]:
        return verify_offline(graph, plan, cache_path=cache_path)
