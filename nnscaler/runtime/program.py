"""Helpers generated programs import."""
from __future__ import annotations

from ..ops.registry import DEFAULT_REGISTRY
from ..ops.spec import OpSpec


def registered(name: str) -> OpSpec:
    """A registered operator whose function has no importable name (a lambda, say)."""
    return DEFAULT_REGISTRY.get(name)
