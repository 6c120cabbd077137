"""Every operator of the zoo matches its single-device self under every partition, at world sizes 2
and 4, over several seeds; and the zoo is the compiler's catalogue: each entry names real ATen ops (bar the
operators the compiler makes itself, ``opzoo.nn.entries.COMPILER_OWN``: the ring's attention)."""
from __future__ import annotations

import pytest
import torch

import opzoo  # noqa: F401  (fills the registry)
from nnscaler import DEFAULT_REGISTRY
from opzoo.nn.entries import COMPILER_OWN

ZOO = sorted(s.name for s in DEFAULT_REGISTRY if not s.family.startswith("test"))
SEEDS = (0, 1)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_op_matches_on_real_ranks(verify_op, name):
    verify_op(name, world_sizes=(2, 4), seeds=SEEDS)  # one subtest per (world size, partition, seed)


def _resolve(overload: str):
    ns, op, name = overload.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), name)


def test_zoo_is_the_catalogue():
    assert len(ZOO) >= 80
    families = {DEFAULT_REGISTRY.get(n).family for n in ZOO}
    assert {"elementwise", "reduction", "linalg", "nn", "shape", "loss"} <= families, families
    for name in ZOO:
        spec = DEFAULT_REGISTRY.get(name)
        if name in COMPILER_OWN:  # ring.scaled_dot_product_attention: made by the ring policies, never traced
            assert not spec.aten and spec.local is not None, name
            continue
        assert spec.aten, f"{name} names no ATen overload"
        for overload in spec.aten:
            _resolve(overload)  # raises if torch has no such overload


@pytest.mark.parametrize("overload", [
    "aten.linear.default", "aten.layer_norm.default", "aten.scaled_dot_product_attention.default",
    "aten.embedding.default", "aten.cross_entropy_loss.default", "aten.add.Tensor", "aten.mul.Tensor",
    "aten.softmax.int", "aten.gelu.default", "aten.view.default", "aten.transpose.int", "aten.matmul.default",
])
def test_ops_export_produces_for_transformers_have_entries(overload):
    assert DEFAULT_REGISTRY.by_aten(overload), f"no zoo entry stands for {overload}"
