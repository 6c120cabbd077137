"""Checkpoints of a parallelized model and its optimizer: sharded on ``torch.distributed.checkpoint``
(each rank writes and reads only its own pieces), loadable under any other plan, at any world size,
or on one device; and a merged single-file export of whole tensors."""
from .sharded import CheckpointError, load, save
from .single import export_merged, load_merged, load_single

__all__ = ["CheckpointError", "save", "load", "export_merged", "load_merged", "load_single"]
