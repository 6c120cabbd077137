"""dimops: the annotation grammar, binding to shapes, and the partition space it spans."""
from .binding import BoundAnno, bind
from .grammar import AnnotationError, OpAnno, parse
from .layout import Layout, Partial, Replicate, Shard, layout_str
from .partition import OpLayout, Partition, check_partition, enumerate_partitions, local_sizes, op_layout, splittable

__all__ = ["BoundAnno", "bind", "AnnotationError", "OpAnno", "parse", "Layout", "Partial", "Replicate", "Shard",
           "layout_str", "OpLayout", "Partition", "check_partition", "enumerate_partitions", "local_sizes",
           "op_layout", "splittable"]
