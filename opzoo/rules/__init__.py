"""Annotation rules: the dimops annotation of an ATen call derived from its shapes and arguments,
one module per family (see :mod:`nnscaler.ops.rules`). Importing this package registers the rules
with :data:`nnscaler.DEFAULT_REGISTRY`, and each rule's example calls as verified zoo entries
(family ``rules``, see :mod:`._examples`)."""
from . import (batch_norm, conv, creation, elementwise, indexing, linalg, loss, moe, nn, recurrent, reduction, selection, shape,  # noqa: F401
               slicing, writes)  # (registers the rules)
from . import examples  # noqa: F401,E402  (after the rules: registers their examples)
from ._examples import EXAMPLES, derive, register_examples  # noqa: F401
