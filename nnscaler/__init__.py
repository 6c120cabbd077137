"""nnscaler: partition a single-device PyTorch model over many ranks, operator by operator."""
from .compile.artifacts import GenSaveDirError
from .compile.gate import UnverifiedPlanWarning, Verifier
from .compile.parallelize import parallelize
from .compile.plan import PlanWarning, plan_model
from .config import ComputeConfig, PlanError
from .dimops import AnnotationError, Partition, bind, enumerate_partitions, op_layout, parse
from .ir.plan import Plan
from .ops import (DEFAULT_REGISTRY, Index, Mask, OpRegistry, OpSpec, Positive, Size, TensorMeta, Tolerance, Uniform,
                  register_op)

__all__ = [
    "AnnotationError", "Partition", "bind", "enumerate_partitions", "op_layout", "parse",
    "DEFAULT_REGISTRY", "Index", "Mask", "OpRegistry", "OpSpec", "Positive", "Size", "TensorMeta", "Tolerance", "Uniform",
    "register_op", "parallelize", "plan_model", "PlanWarning", "ComputeConfig", "Plan", "PlanError",
    "GenSaveDirError", "UnverifiedPlanWarning", "Verifier",
]
