"""Whole models the harness verifies end to end (and the examples use). Importing the package loads
the catalogue: each module below registers its models in :mod:`.registry` (the ``transformers``
models where that package is installed)."""
from verify.models import builders, contrastive, conv1d, recurrent, resnet_gn, speech  # noqa: F401  (register their models)

try:
    import transformers  # noqa: F401
except ImportError:  # the transformers models are optional
    pass
else:
    from verify.models import hf, hf_more  # noqa: F401  (llama, gpt2, bert, gpt2_v96; mixtral, qwen3, gemma, ...)
