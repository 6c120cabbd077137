"""Operator specs and the registry the compiler and the harness share."""
from .registry import DEFAULT_REGISTRY, OpRegistry, UnknownOpError, annotation_rule, register_op
from .rules import OpCall, TensorMeta, aten_overload
from .spec import Complex, Index, Mask, OpSpec, Positive, Size, Tolerance, Uniform, resolve

__all__ = ["DEFAULT_REGISTRY", "OpRegistry", "UnknownOpError", "annotation_rule", "register_op", "OpCall",
           "TensorMeta", "aten_overload", "Index", "Mask", "OpSpec",
           "Positive", "Size", "Tolerance", "Uniform", "resolve"]
