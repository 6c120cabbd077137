"""Policies: functions ``(graph, config) -> Plan`` that give every operator a partition."""
from .builtin import POLICIES, cp, dp, hybrid, hybrid_cp, random, random2d, tp
from ..config import ComputeConfig, PlanError
from ..ir.plan import Plan, validate
from .autodist import autodist
from .context import cp_balanced, cp_tp_balanced, hybrid_cp_balanced
from .cp_mesh import cp_tp, cp_tp_ulysses, ulysses
from .ring import cp_ring, cp_ring_balanced, cp_tp_ring, cp_tp_ring_balanced

POLICIES["cp_tp"], POLICIES["cp_tp_balanced"] = cp_tp, cp_tp_balanced
POLICIES["ulysses"], POLICIES["cp_tp_ulysses"] = ulysses, cp_tp_ulysses
POLICIES["autodist"] = autodist
POLICIES["cp_balanced"], POLICIES["hybrid_cp_balanced"] = cp_balanced, hybrid_cp_balanced
POLICIES.update(cp_ring=cp_ring, cp_ring_balanced=cp_ring_balanced, cp_tp_ring=cp_tp_ring, cp_tp_ring_balanced=cp_tp_ring_balanced)

__all__ = ["POLICIES", "autodist", "cp", "cp_balanced", "cp_ring", "cp_ring_balanced", "cp_tp", "cp_tp_balanced", "cp_tp_ring", "cp_tp_ring_balanced", "cp_tp_ulysses", "dp", "hybrid", "hybrid_cp", "hybrid_cp_balanced", "random", "random2d", "tp", "ulysses", "ComputeConfig", "Plan", "PlanError",
           "validate"]
