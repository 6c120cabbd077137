"""Operator specs and the registry the compiler and the harness share."""
from .registry import DEFAULT_REGISTRY, OpRegistry, UnknownOpError, register_op
from .spec import Index, Mask, OpSpec, Positive, Size, Tolerance, Uniform, resolve

__all__ = ["DEFAULT_REGISTRY", "OpRegistry", "UnknownOpError", "register_op", "Index", "Mask", "OpSpec",
           "Positive", "Size", "Tolerance", "Uniform", "resolve"]
