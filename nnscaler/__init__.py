"""nnscaler: partition a single-device PyTorch model over many ranks, operator by operator."""
from .dimops import AnnotationError, Partition, bind, enumerate_partitions, op_layout, parse
from .parallel import parallelize
from .policies import ComputeConfig, Plan, PlanError
from .ops import (DEFAULT_REGISTRY, Index, Mask, OpRegistry, OpSpec, Positive, Size, TensorMeta, Tolerance, Uniform,
                  register_op)

__all__ = [
    "AnnotationError", "Partition", "bind", "enumerate_partitions", "op_layout", "parse",
    "DEFAULT_REGISTRY", "Index", "Mask", "OpRegistry", "OpSpec", "Positive", "Size", "TensorMeta", "Tolerance", "Uniform",
    "register_op", "parallelize", "ComputeConfig", "Plan", "PlanError",
]
