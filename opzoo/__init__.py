"""The built-in operator catalogue: importing ``opzoo`` registers every family's operators, with
their dimops annotations, into :data:`nnscaler.DEFAULT_REGISTRY`.

One module per family; partition-aware kernels shared by several entries live in
:mod:`opzoo._parallel_kernels`.
"""
from . import (activation, elementwise, indexing, linalg, loss, nn, normalization,  # noqa: F401
               reduction, shape)
from . import rules  # noqa: F401,E402  (annotation rules and their verified examples)
from . import experts  # noqa: F401,E402  (expert parallelism: nnscaler::moe_experts)

FAMILIES = ("elementwise", "activation", "reduction", "normalization", "linalg", "nn", "loss", "shape",
            "indexing")
