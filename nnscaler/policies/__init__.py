"""Policies: functions ``(graph, config) -> Plan`` that give every operator a partition."""
from .builtin import POLICIES, dp, hybrid, random, tp
from .plan import ComputeConfig, Plan, PlanError, validate
from .autodist import autodist

POLICIES["autodist"] = autodist

__all__ = ["POLICIES", "autodist", "dp", "hybrid", "random", "tp", "ComputeConfig", "Plan", "PlanError", "validate"]
