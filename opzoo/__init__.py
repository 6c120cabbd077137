"""The built-in operator catalogue: importing ``opzoo`` registers every family's operators, with
their dimops annotations, into :data:`nnscaler.DEFAULT_REGISTRY`.

One folder per family, ``opzoo/<family>/``, holding what the family has of ``entries.py`` (operators
with a fixed annotation), ``rules.py`` (annotation rules derived per ATen call, see
:mod:`nnscaler.ops.rules`) and ``examples.py`` (the rules' verified example calls, zoo entries
``rule.<op>.<i>``). Shared by the families: :mod:`opzoo.rulekit` (writing rules and registering their
examples) and :mod:`opzoo.kernels` (partition-aware kernels).

The modules load in three passes, in this order: every family's entries, every family's rules, then
the examples (each derived by the rules already registered), and last the expert-parallel operator.
"""
# 1. operators with a fixed annotation
from .activation import entries as _activation_entries  # noqa: F401
from .elementwise import entries as _elementwise_entries  # noqa: F401
from .indexing import entries as _indexing_entries  # noqa: F401
from .linalg import entries as _linalg_entries  # noqa: F401
from .loss import entries as _loss_entries  # noqa: F401
from .nn import entries as _nn_entries  # noqa: F401
from .normalization import entries as _normalization_entries  # noqa: F401
from .reduction import entries as _reduction_entries  # noqa: F401
from .shape import entries as _shape_entries  # noqa: F401

# 2. annotation rules (for one overload, rules are asked in the order registered)
from .batch_norm import rules as _batch_norm_rules  # noqa: F401,E402  (registers its example too)
from .conv import rules as _conv_rules  # noqa: F401,E402
from .creation import rules as _creation_rules  # noqa: F401,E402
from .elementwise import rules as _elementwise_rules  # noqa: F401,E402
from .indexing import rules as _indexing_rules  # noqa: F401,E402
from .linalg import rules as _linalg_rules  # noqa: F401,E402
from .loss import rules as _loss_rules  # noqa: F401,E402
from .moe import rules as _moe_rules  # noqa: F401,E402
from .nn import rules as _nn_rules  # noqa: F401,E402
from .recurrent import rules as _recurrent_rules  # noqa: F401,E402
from .reduction import rules as _reduction_rules  # noqa: F401,E402
from .selection import rules as _selection_rules  # noqa: F401,E402
from .shape import rules as _shape_rules  # noqa: F401,E402
from .slicing import rules as _slicing_rules  # noqa: F401,E402
from .writes import rules as _writes_rules  # noqa: F401,E402

# 3. the rules' verified examples (after every rule)
from .conv import examples as _conv_examples  # noqa: F401,E402
from .creation import examples as _creation_examples  # noqa: F401,E402
from .elementwise import examples as _elementwise_examples  # noqa: F401,E402
from .indexing import examples as _indexing_examples  # noqa: F401,E402
from .linalg import examples as _linalg_examples  # noqa: F401,E402
from .loss import examples as _loss_examples  # noqa: F401,E402
from .moe import examples as _moe_examples  # noqa: F401,E402
from .nn import examples as _nn_examples  # noqa: F401,E402
from .recurrent import examples as _recurrent_examples  # noqa: F401,E402
from .reduction import examples as _reduction_examples  # noqa: F401,E402
from .selection import examples as _selection_examples  # noqa: F401,E402
from .shape import examples as _shape_examples  # noqa: F401,E402
from .slicing import examples as _slicing_examples  # noqa: F401,E402
from .writes import examples as _writes_examples  # noqa: F401,E402

# 4. expert parallelism: nnscaler::moe_experts (its rule and example beside it)
from .moe import experts as _moe_experts  # noqa: F401,E402

FAMILIES = ("elementwise", "activation", "reduction", "normalization", "linalg", "nn", "loss", "shape",
            "indexing")
