"""nnscaler: partition a single-device PyTorch model over many ranks, operator by operator.

The names below are imported when first read (PEP 562), so a torch-free module of the package
(:mod:`nnscaler.recipe`, whose fields the ``verify`` command line reads) imports without torch."""
from __future__ import annotations

import importlib

_HOMES = {
    ".compile.artifacts": ("GenSaveDirError",),
    ".compile.gate": ("UnverifiedPlanWarning", "Verifier"),
    ".cluster.autodist": ("parallelize", "plan_model"),  # autodist at every scale, else the compiler's own
    ".compile.plan": ("PlanWarning",),
    ".config": ("ComputeConfig", "PlanError"),
    ".dimops": ("AnnotationError", "Partition", "bind", "enumerate_partitions", "op_layout", "parse"),
    ".ir.plan": ("Plan",),
    ".ops": ("DEFAULT_REGISTRY", "Index", "Mask", "OpRegistry", "OpSpec", "Positive", "Size", "TensorMeta",
             "Tolerance", "Uniform", "register_op"),
    ".recipe": ("Recipe",),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "AnnotationError", "Partition", "bind", "enumerate_partitions", "op_layout", "parse",
    "DEFAULT_REGISTRY", "Index", "Mask", "OpRegistry", "OpSpec", "Positive", "Size", "TensorMeta", "Tolerance", "Uniform",
    "register_op", "parallelize", "plan_model", "PlanWarning", "ComputeConfig", "Plan", "PlanError",
    "GenSaveDirError", "UnverifiedPlanWarning", "Verifier", "Recipe",
]


def __getattr__(name: str):
    if name not in _HOME:  # a subpackage (nnscaler.compile, ...): bound once the whole face is imported
        if name.startswith("__"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        for module in _HOMES:
            importlib.import_module(module, __name__)
        if name in globals():
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name], __name__), name)
    globals()[name] = value  # once: later reads find it directly
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
