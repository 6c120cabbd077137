"""nnscaler: partition a single-device PyTorch model over many ranks, operator by operator."""
from .dimops import AnnotationError, Partition, bind, enumerate_partitions, op_layout, parse
from .parallel import parallelize
from .plan_api import PlanWarning, plan_model
from .policies import ComputeConfig, Plan, PlanError
from .ops import (DEFAULT_REGISTRY, Index, Mask, OpRegistry, OpSpec, Positive, Size, TensorMeta, Tolerance, Uniform,
                  register_op)

__all__ = [
    "AnnotationError", "Partition", "bind", "enumerate_partitions", "op_layout", "parse",
    "DEFAULT_REGISTRY", "Index", "Mask", "OpRegistry", "OpSpec", "Positive", "Size", "TensorMeta", "Tolerance", "Uniform",
    "register_op", "parallelize", "plan_model", "PlanWarning", "ComputeConfig", "Plan", "PlanError",
]
