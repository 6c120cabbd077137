"""The operator names the cluster cost model's block reader (``nnscaler/cluster/blocks.py``) says keep
tensors for backward are matched against each traced operator's aten name: each must name an aten
operator (``cross_entropy`` does not: the traced loss is ``aten.cross_entropy_loss``), and the loss of
a traced nanoGPT keeps its logits."""
from __future__ import annotations

import warnings

import torch

from nnscaler.cluster import blocks
from nnscaler.cluster.blocks import model_shape
from nnscaler.trace.build import trace
from verify.models.nanogpt import GPT, GPTConfig


def test_every_name_of_what_operators_save_is_an_aten_operator():
    names = {n for n in vars(blocks) if n.endswith(("SAVES_INPUTS", "SAVES_OUTPUT", "PRODUCTS"))}
    assert len(names) == 3, names
    unknown = [op for n in names for op in getattr(blocks, n) if not hasattr(torch.ops.aten, op)]
    assert not unknown, f"names matched against no traced operator: {unknown}"


def test_the_loss_of_a_traced_model_keeps_its_logits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    args = (torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8)))  # one sequence: the flat logits are token-shaped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shape = model_shape(trace(model, args), 1, 8)
    loss = [f for f in shape.post.ops if "cross_entropy" in f.name]
    assert loss, [f.name for f in shape.post.ops]
    logits = 8 * shape.vocab
    assert sum(f.saved + f.saved_whole for f in loss) >= logits, [(f.name, f.saved, f.saved_whole) for f in loss]
