"""The cluster planner: the outer configuration of a real training run (tp x pp x dp, schedule,
micro-batches, ZeRO, recompute) searched on the cluster cost model, above the compiler that runs it.
:func:`plan_cluster` plans a model; a saved plan is read back by :func:`~nnscaler.cluster.plan.load`."""
from .search import ClusterPlan, plan_cluster, search

__all__ = ["ClusterPlan", "plan_cluster", "search"]
