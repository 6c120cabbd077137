"""Example calls of every rule, registered as verified zoo entries (``rule.<op>.<i>``).

Each list covers the distinct cases of its rule: split and merged dims, ``-1``, negative dims,
broadcasting from the left and with 1s, 0-d tensors, keepdim, several reduced dims, optional
tensors given or None. The harness samples its own lengths from the derived annotations.
"""
from __future__ import annotations

import torch

from ._common import INT_MAX
from ._examples import T, ex, register_examples

I64, BOOL = torch.int64, torch.bool


def I(*shape: int):  # noqa: E743
    return T(*shape, dtype=I64)


def B(*shape: int):
    return T(*shape, dtype=BOOL)


# --- shape ----------------------------------------------------------------------------------------
register_examples("aten.view.default", [
    (T(2, 8, 32), [2, 8, 4, 8]), (T(2, 8, 4, 8), [2, 8, 32]), (T(2, 8, 64), [-1, 64]),
    (T(8, 2, 32), [8, 8, 8]), (T(2, 6, 4), [2, 4, 6]), (T(2, 1, 8), [2, 8, 1]), (T(2, 8), [-1])])
register_examples("aten.reshape.default", [
    (T(8, 2, 4, 8), [16, 32]), (T(2, 8, 4, 8), [2, 8, -1]), (T(2, 2, 2, 8, 8), [2, 4, 8, 8]),
    (T(2, 2, 4, 8, 16), [2, 8, 8, 16]), (T(2, 1, 4, 8, 16), [2, 4, 8, 16])])  # repeat_kv: (kv heads, repeats) -> heads
register_examples("aten._unsafe_view.default", [(T(4, 6), [24]), (T(24,), [2, 3, 4])])
register_examples("aten.flatten.using_ints", [(T(2, 3, 4, 5), 1, 2), (T(2, 8, 4), 0, -1), (T(4, 6),)])
register_examples("aten.unflatten.int", [(T(8, 2, 96), -1, [3, 32]), (T(2, 12), 1, [-1, 4]),
                                         (T(12, 5), 0, [1, 12])])
register_examples("aten.squeeze.dim", [(T(3, 8, 2, 1, 32), -2), (T(2, 8), 0), (T(4, 1), 0)])
register_examples("aten.squeeze.dims", [(T(1, 4, 1, 8), [0, 2]), (T(4, 1, 8), [0, 1])])
register_examples("aten.squeeze.default", [(T(2, 1, 8, 1),)])
register_examples("aten.unsqueeze.default", [(T(2, 8), 1), (T(8), 0), (T(2, 8), -1)])
register_examples("aten.transpose.int", [(T(2, 8, 4, 8), 1, 2), (T(1, 8, 2, 3, 32), 0, -2),
                                         (T(2, 4, 8, 6), -1, -2)])
register_examples("aten.permute.default", [(T(2, 4, 8, 6), [2, 0, 1, 3]), (T(2, 3, 4), [-1, 0, 1])])
register_examples("aten.t.default", [(T(4, 8),), (T(8),)])
register_examples("aten.expand.default", [(T(1, 8), [12, -1]), (T(8, 1), [8, 12]), (T(4, 8), [12, 4, 8]),
                                          (B(2, 1, 8, 1), [2, -1, 8, 8]),
                                          (T(2, 2, 1, 8, 16), [2, 2, 4, 8, 16])])  # repeat_kv's repeats
register_examples("aten.contiguous.default", [(T(2, 8, 4, 8),)])
register_examples("aten.clone.default", [(T(2, 8, 6),)])
register_examples("aten.alias.default", [(T(2, 8),)])
register_examples("aten.split.Tensor", [(T(2, 8, 96), 32, 2), (T(12, 8), 4), (T(2, 10), 4, -1)])
register_examples("aten.split_with_sizes.default", [(T(2, 8, 96), [32, 32, 32], -1), (T(2, 5), [2, 3], 1)])
register_examples("aten.chunk.default", [(T(2, 8, 12), 3, -1), (T(8, 2), 2), (T(2, 7), 3, 1)])
register_examples("aten.unbind.int", [(T(3, 8, 2, 32), 0), (T(4, 6, 2), -1)])
register_examples("aten.slice.Tensor", [
    (T(2, 4, 8, 8), 3, 0, 4), (T(2, 4, 8, 8), 3, 4, INT_MAX), (I(2, 9), 1, 1, INT_MAX),
    (T(2, 8), 1, 0, INT_MAX), (T(6, 8), 0, 1, 5, 2), (T(2, 8), 1, 0, 8), (T(4, 6), -1, -3)])
register_examples("aten.pad.default", [(I(2, 8), [0, 1], "constant", -100.0), (T(2, 4, 6), [1, 2, 0, 0]),
                                       (T(2, 4, 6), [1, 1, 2, 0], "reflect")])
register_examples("aten.select.int", [(T(3, 8, 2, 32), 0, 1), (T(2, 5, 4), -2, -1)])
register_examples("aten.cat.default", [([T(2, 4, 8, 4), T(2, 4, 8, 4)], -1), ([T(3, 8), T(5, 8)],),
                                       ([T(2, 3, 4), T(2, 1, 4), T(2, 2, 4)], 1)])
register_examples("aten.stack.default", [([T(2, 8), T(2, 8)],), ([T(4, 3), T(4, 3), T(4, 3)], -1)])

# --- element-wise ---------------------------------------------------------------------------------
_SHAPES = [(2, 8, 6), (8,), (4, 1, 6), (3, 5)]
_UNARY = ["neg", "exp", "log", "rsqrt", "sqrt", "abs", "sin", "erf", "reciprocal", "relu", "gelu", "silu",
          "tanh", "sigmoid", "log_sigmoid"]
for _i, _op in enumerate(_UNARY):
    register_examples(f"aten.{_op}.default", [(T(*_SHAPES[_i % len(_SHAPES)]),)])
register_examples("aten.gelu.default", [ex(T(4, 8), approximate="tanh")])
register_examples("aten.neg.default", [(T(),)])
register_examples("aten.leaky_relu.default", [(T(4, 8), 0.1)])
register_examples("aten.hardtanh.default", [(T(4, 8), -0.5, 0.5)])
register_examples("aten.clamp.default", [(T(4, 8), -0.5, 0.5), ex(T(4, 8), max=0.2)])
register_examples("aten.add.Tensor", [
    (T(2, 8, 32), T(8, 32)), (T(2, 4, 8, 8), T(2, 1, 8, 8)), (T(2, 8, 1), 1e-6), (T(8), T(2, 1)),
    ex(T(2, 8), T(2, 8), alpha=2), (I(8), 0)])
register_examples("aten.sub.Tensor", [(T(2, 1), 1), (T(4, 8), T(4, 1)), (T(), T(3, 4))])
register_examples("aten.mul.Tensor", [(T(32), T(2, 8, 32)), (T(2, 4, 8, 8), T(1, 1, 8, 8)), (T(2, 8, 12), 0.5)])
register_examples("aten.div.Tensor", [(T(2, 8), T(8)), (T(4, 8), 3.0), (T(4, 1, 8), T(4, 6, 1))])
register_examples("aten.pow.Tensor_Scalar", [(T(2, 8, 32), 2), (T(4, 8), 0.5)])
register_examples("aten.rsub.Scalar", [(T(4, 8), 1.0)])
register_examples("aten.maximum.default", [(T(4, 8), T(8))])
register_examples("aten.minimum.default", [(T(4, 1), T(1, 8))])
register_examples("aten.min.other", [(T(4, 8), T(4, 8))])
register_examples("aten.max.other", [(T(4, 1), T(1, 8))])
register_examples("aten.where.self", [(B(2, 1, 8, 8), T(2, 4, 8, 8), T(8)), (B(4, 8), T(4, 8), T())])
register_examples("aten.where.ScalarOther", [(B(2, 1, 8, 8), T(), -3.0), (B(4, 8), T(4, 8), 0.0)])
register_examples("aten.masked_fill.Scalar", [(T(2, 4, 8, 8), B(8, 8), -1e4)])
register_examples("aten.eq.Tensor", [(I(2, 1, 8, 1), I(2, 1, 1, 8))])
register_examples("aten.le.Tensor", [(I(2, 1, 1, 8), I(2, 1, 8, 1))])
register_examples("aten.ne.Scalar", [(I(2, 8), 1)])
register_examples("aten.ge.Scalar", [(I(1, 1, 8, 1), 0)])
register_examples("aten.__and__.Tensor", [(B(), B(2, 1, 8, 8)), (B(2, 8), B(2, 8))])
register_examples("aten.to.dtype", [(T(2, 8, 32), torch.float32), (T(4, 8), torch.float64)])
register_examples("aten.to.dtype_layout", [ex(T(16, 4), dtype=torch.float32, layout=torch.strided,
                                              device=torch.device("cpu"))])
register_examples("aten._to_copy.default", [ex(T(4, 8), dtype=torch.float64)])
register_examples("aten.to.device", [(T(4, 8), torch.device("cpu"), torch.float64)])
register_examples("aten.dropout.default", [(T(2, 8, 32), 0.0, True), (T(2, 4, 8, 8), 0.1, False), (T(4, 6, 8), 0.25, True)])

# --- reductions -----------------------------------------------------------------------------------
register_examples("aten.sum.dim_IntList", [(T(2, 8, 32), [-1]), (T(2, 8, 32), [0, 2], True),
                                           (T(2, 3, 4, 5), [1, -1]), (T(4, 6), None), (T(4, 1, 6), [1])])
register_examples("aten.sum.default", [(T(4, 8),), (T(2, 3, 4),)])
register_examples("aten.mean.dim", [(T(2, 8, 32), [-1], True), (T(2, 8, 32), [0, 2]), (T(4, 6, 8), [1]),
                                    (T(4, 6), [])])
register_examples("aten.mean.default", [(T(4, 8),)])
register_examples("aten.softmax.int", [(T(2, 4, 8, 8), -1), (T(4, 8, 6), 1), (T(2, 4, 8, 8), -1, torch.float32)])
register_examples("aten.log_softmax.int", [(T(4, 8), 0), (T(2, 3, 8), -1)])
register_examples("aten._softmax.default", [(T(4, 8), -1, False)])
register_examples("aten.cumsum.default", [(T(4, 8), 0), (B(2, 8), -1)])

# --- layers ---------------------------------------------------------------------------------------
register_examples("aten.layer_norm.default", [
    (T(2, 8, 32), [32], T(32), T(32), 1e-5, False), (T(4, 6, 8), [6, 8], T(6, 8), T(6, 8)), (T(4, 8), [8]),
    (T(4, 8), [8], None, T(8))])
register_examples("aten.rms_norm.default", [(T(2, 8, 32), [32], T(32), 1e-6), (T(4, 8), [8])])
register_examples("aten.embedding.default", [(T(64, 32), I(2, 8)), (T(16, 32), I(8)), (T(64, 32), I(2, 8), 0)])
_Q = T(2, 4, 8, 8)
register_examples("aten.scaled_dot_product_attention.default", [
    (_Q, _Q, _Q, None, 0.0, True), (_Q, _Q, _Q), (_Q, _Q, _Q, T(2, 1, 8, 8)), (T(2, 4, 6, 8), T(2, 4, 10, 8),
                                                                            T(2, 4, 10, 5), T(6, 10)),
    (_Q, _Q, _Q, B(8, 8)), ex(_Q, T(2, 2, 8, 8), T(2, 2, 8, 8), enable_gqa=True),
    ex(T(4, 6, 8), T(4, 6, 8), T(4, 6, 8), scale=0.3)])
register_examples("aten.linear.default", [(T(2, 8, 32), T(96, 32), T(96)), (T(16, 32), T(32, 32)),
                                          (T(32), T(8, 32), T(8)), (T(2, 3, 4, 32), T(8, 32))])
register_examples("aten.matmul.default", [
    (T(2, 4, 8, 8), T(2, 4, 8, 8)), (T(2, 4, 8, 6), T(6, 5)), (T(8), T(8)), (T(4, 8), T(8)),
    (T(8), T(2, 8, 5)), (T(2, 1, 8, 6), T(3, 6, 5))])
register_examples("aten.einsum.default", [  # funnel's attention, a sum, an outer product, ..., broadcasting
    ("bind,bjnd->bnij", [T(2, 8, 4, 6), T(2, 8, 4, 6)]), ("bnij,bjnd->bind", [T(2, 4, 8, 8), T(2, 8, 4, 6)]),
    ("binh,dnh->bind", [T(2, 8, 4, 6), T(5, 4, 6)]), ("ij->i", [T(8, 6)]), ("i,j", [T(8), T(6)]),
    ("...ij,...jk->...ik", [T(2, 4, 8, 6), T(4, 6, 5)]), ("bij,xjk->bik", [T(2, 8, 6), T(1, 6, 5)]),
    ("ab,bc,cd->ad", [T(4, 6), T(6, 8), T(8, 2)])])
register_examples("aten.cross_entropy_loss.default", [
    (T(16, 64), I(16), None, 1, -1), (T(16, 64), I(16)), (T(16, 64), I(16), None, 0),
    (T(16, 64), I(16), None, 2, -100)])
register_examples("aten.nll_loss_nd.default", [(T(16, 10), I(16), None, 1, -100), (T(16, 10), I(16), None, 0)])

# --- creation, metadata, casts ----------------------------------------------------------------------
_CPU = torch.device("cpu")
register_examples("aten.arange.default", [ex(8, device=_CPU, pin_memory=False), ex(1), ex(6, dtype=torch.float32)])
register_examples("aten.arange.start", [(2, 9)])
register_examples("aten.arange.start_step", [(0, 12, 3)])
register_examples("aten.zeros.default", [ex([], dtype=torch.float32), ex([4, 6])])
register_examples("aten.ones.default", [ex([3, 4], dtype=torch.bool)])
register_examples("aten.full.default", [([2, 5], -1.5), ex([], 7, dtype=I64)])
register_examples("aten.empty.memory_format", [ex([4, 3], dtype=torch.float32)])
register_examples("aten.scalar_tensor.default", [ex(2.5, dtype=torch.float32)])
register_examples("aten.new_ones.default", [ex(I(1, 1, 8, 1), [], dtype=BOOL), (T(4, 8), [2, 3])])
register_examples("aten.new_zeros.default", [(T(4, 8), [6]), (I(4, 8), [4, 8])])
register_examples("aten.new_full.default", [(T(4, 8), [2, 2], 3.0)])
register_examples("aten.new_empty.default", [(T(4, 8), [3, 2])])
register_examples("aten.empty_like.default", [ex(I(64), pin_memory=False), (T(4, 8),)])
register_examples("aten.zeros_like.default", [(T(2, 8, 6),)])
register_examples("aten.ones_like.default", [(I(4, 8),)])
register_examples("aten.full_like.default", [(T(4, 8), -2.0)])
register_examples("aten.type_as.default", [(T(4, 8, 6), T(4, 8, 6)), (T(4, 8), T(3, dtype=torch.float64)),
                                           (T(2, 8), I(5))])
register_examples("aten._assert_tensor_metadata.default", [
    ex(T(4, 8, 6), dtype=torch.float32, device=_CPU, layout=torch.strided), ex(B(4, 1, 8, 8), dtype=BOOL),
    ex(T(8), None, None, torch.float32)])

# --- indexing and mixture-of-experts bookkeeping ------------------------------------------------------
register_examples("aten.index.Tensor", [(T(64, 48), [I(64)]), (T(3, 12, 8), [I(16)]),
                                        (I(4, 8), [I(4, 1, 1, 1), I(1, 1, 8, 1)]), (T(10,), [I(4, 6)]),
                                        (T(4, 8, 6, 16), [None, None, I(2)])])
register_examples("aten.gather.default", [(T(4, 4, 8, 24), -1, I(4, 4, 8, 8)), (T(12, 6), 0, I(4, 6)),
                                          (T(8, 16), 1, I(8, 16))])
register_examples("aten.index_select.default", [(T(4, 8, 15), 2, I(8)), (T(12, 6), 0, I(5)), (T(6, 12), -1, I(12))])
register_examples("aten.index_put.default", [(I(16), [I(16)], I(16)), (T(8, 4), [I(6)], T(6, 4), True),
                                            (I(4, 8), [B(4, 8)], I()), (T(4, 8, 6), [B(4, 8)], T(1), True),
                                            (T(4, 8, 6), [B(4, 8)], T(6))])
register_examples("aten.index_put_.default", [(I(16), [I(16)], I(16))])
register_examples("aten.diff.default", [(I(4, 8), 1, -1, I(4, 1)), (T(6, 5),), (T(4, 7), 1, 0, None, T(1, 7))])
register_examples("aten.repeat_interleave.self_int", [(T(8, 6), 2, 0), (T(4, 3, 6), 3, 1), (I(8), 2, 0)])
register_examples("aten.histc.default", [(T(64), 3, 0, 2), (T(4, 8), 5, -1.0, 1.0)])
register_examples("aten._grouped_mm.default", [(T(16, 8), T(3, 8, 12), T(3, dtype=torch.int32)),
                                               (T(12, 4), T(2, 4, 8), T(2, dtype=torch.int32))])
register_examples("aten.floor_divide.default", [(I(64), 2), (T(4, 8), T(8))])
register_examples("aten.div_.Tensor", [(T(32, 2), T(32, 1))])
register_examples("aten.mul_.Tensor", [(T(4, 8), 0.5)])
register_examples("aten.broadcast_tensors.default", [([T(4, 8, 6), T(4, 8, 6)],), ([T(4, 1), T(1, 6)],)])
register_examples("aten.mse_loss.default", [(T(4, 8, 6), T(4, 8, 6)), (T(4, 8), T(4, 8), 2), (T(4, 6), T(4, 6), 0)])

# --- convolutions and group norm as nn.Conv2d / nn.GroupNorm trace them ------------------------------
register_examples("aten.conv2d.default", [(T(4, 3, 8, 8), T(12, 3, 3, 3), T(12), [1, 1], [1, 1]),
                                          (T(4, 12, 8, 8), T(24, 12, 3, 3), None, [2, 2], [1, 1]),
                                          (T(4, 3, 8, 8), T(6, 3, 4, 4), T(6), [4, 4]),
                                          (T(4, 1, 8, 8), T(6, 1, 3, 3), T(6))])  # one input channel, a bias
register_examples("aten.conv1d.default", [(T(4, 6, 9), T(8, 6, 3), T(8), [1], [1]), (T(2, 4, 10), T(6, 4, 2)),
                                          (T(4, 12, 9), T(12, 4, 3), T(12), [1], [1], [1], 3),  # grouped
                                          (T(4, 8, 10), T(8, 1, 5), None, [1], [2], [1], 8)])  # depthwise
register_examples("aten.conv1d.padding", [(T(4, 6, 9), T(8, 6, 3), T(8), [1], "same"),
                                          (T(4, 12, 16), T(12, 4, 3), None, [1], "same", [2], 3)])
register_examples("aten.conv2d.padding", [(T(4, 6, 8, 8), T(12, 2, 3, 3), T(12), [1, 1], "same", [1, 1], 3)])
register_examples("aten.group_norm.default", [(T(4, 12, 8, 8), 3, T(12), T(12), 1e-5, False),
                                              (T(4, 6, 5), 6, T(6), T(6)), (T(2, 6, 4, 4), 1, T(6), T(6), 1e-5, True),
                                              (T(4, 12, 5), 3)])
register_examples("aten.slice.Tensor", [(T(4, 3, 8, 16), 3, 16, INT_MAX)])
register_examples("aten.cat.default", [([T(4, 3, 8, 16), T(4, 3, 8, 0)], -1)])
register_examples("aten.topk.default", [(T(32, 3), 2), (T(4, 8, 6), 3, 1), ex(T(4, 6), 2, largest=False)])
register_examples("aten.sort.default", [(T(4, 8),), (I(64),), (T(6, 4), 0, True)])
register_examples("aten.sort.stable", [ex(T(4, 8), stable=True, dim=0)])

# --- functionalized writes into a slice (T5's _shift_right) -----------------------------------------
register_examples("aten.slice_scatter.default", [(T(4, 8), T(4, 7), 1, 1, INT_MAX), (T(6, 4, 3), T(2, 4, 3), 0, 0, 2),
                                                 (I(4, 8), I(4, 8), 1)])
register_examples("aten.select_scatter.default", [(T(4, 8), T(4), 1, 0), (T(3, 4, 5), T(4, 5), 0, -1)])
register_examples("aten.copy.default", [(T(4, 7), T(4, 7)), (I(4, 6), I(6))])
register_examples("aten.fill.Tensor", [(I(4,), I()), (T(4, 8), T())])
register_examples("aten.fill.Scalar", [(T(4, 8), 0.5)])


# --- key/value caches, shifted windows, transposed convolutions, recurrent layers, spreads -----------
register_examples("aten.cat.default", [([T(0), T(4, 2, 8, 16)], -2), ([T(0), T(4, 6), T(4, 2)], 1)])
register_examples("aten.concatenate.default", [([T(4, 2, 4, 16), T(4, 2, 4, 16)], 2), ([T(0), T(3, 8)],)])
register_examples("aten.roll.default", [(T(2, 6, 6, 8), [3, -3], [1, 2]), (T(4, 8), [2]), (T(4, 6, 5), [1], [-1])])
register_examples("aten.conv_transpose1d.default", [(T(4, 6, 9), T(6, 8, 4), T(8), [2]),
                                                    (T(4, 6, 9), T(6, 2, 3), None, [1], [1], [0], 3)])
register_examples("aten.conv_transpose2d.input", [(T(2, 4, 5, 5), T(4, 6, 3, 3), T(6), [2, 2], [1, 1], [1, 1]),
                                                  (T(2, 8, 4, 4), T(8, 3, 2, 2), T(12), [2, 2], [0, 0], [0, 0], 4)])
register_examples("aten.avg_pool1d.default", [(T(2, 4, 8), [2]), (T(4, 6, 9), [3], [2], [1])])
register_examples("aten.avg_pool2d.default", [(T(2, 4, 8, 8), [2, 2])])
register_examples("aten.max_pool1d.default", [(T(2, 4, 8), [2])])
register_examples("aten.max_pool2d.default", [(T(2, 4, 8, 8), [3, 3], [2, 2], [1, 1])])
register_examples("aten.adaptive_avg_pool1d.default", [(T(2, 4, 8), [1]), (T(4, 6, 9), [3])])
register_examples("aten.adaptive_avg_pool2d.default", [(T(2, 4, 8, 8), [1, 1])])
register_examples("aten.conv_transpose3d.input", [(T(2, 3, 3, 4, 4), T(3, 4, 2, 2, 2), None, [2, 2, 2])])
register_examples("aten.var.dim", [(T(4, 8, 2, 16), [-1], False, True), (T(4, 8), [0])])
register_examples("aten.var.correction", [ex(T(4, 8, 6), [1, 2], correction=0, keepdim=True), (T(4, 8),)])
register_examples("aten.std.correction", [ex(T(4, 8), [-1], correction=1)])
register_examples("aten.std.dim", [(T(3, 8, 5), [1], True, False)])


def _rnn_params(gates: int, inp: int, hid: int, layers: int = 1, bidirectional: bool = False, bias: bool = True):
    """The flat weight list of ``nn.RNN/GRU/LSTM`` (per layer and direction: w_ih, w_hh[, b_ih, b_hh])."""
    out, dirs = [], 2 if bidirectional else 1
    for layer in range(layers):
        for _ in range(dirs):
            out += [T(gates * hid, inp if layer == 0 else hid * dirs), T(gates * hid, hid)]
            out += [T(gates * hid), T(gates * hid)] if bias else []
    return out


register_examples("aten.gru.input", [(T(4, 5, 6), T(2, 4, 8), _rnn_params(3, 6, 8, 2), True, 2, 0.0, True, False, True),
                                     (T(5, 4, 6), T(2, 4, 8), _rnn_params(3, 6, 8, 1, True, False), False, 1, 0.0,
                                      True, True, False)])
register_examples("aten.lstm.input", [(T(4, 5, 6), [T(1, 4, 8), T(1, 4, 8)], _rnn_params(4, 6, 8), True, 1, 0.0, True,
                                       False, True)])
register_examples("aten.rnn_tanh.input", [(T(4, 5, 6), T(1, 4, 8), _rnn_params(1, 6, 8), True, 1, 0.0, True, False, True)])
register_examples("aten.max.dim", [(T(4, 4, 8, 8), -1, True), (T(4, 6), 0)])
register_examples("aten.min.dim", [(T(4, 6, 5), 1)])
register_examples("aten.argmax.default", [(T(4, 6), 1), (T(4, 6, 5), -1, True), (T(4, 6),)])
register_examples("aten.argmin.default", [(T(4, 6), 0)])
register_examples("aten.amax.default", [(T(4, 6, 5), [1, 2]), (T(4, 6), [-1], True)])
register_examples("aten.amin.default", [(T(4, 6), [0])])
register_examples("aten.tril.default", [(T(4, 2, 6, 6), -1), (T(5, 7),)])
register_examples("aten.triu.default", [(T(3, 6, 6), 1)])
register_examples("aten.scatter.value", [(T(32, 4), 1, I(32, 1), 1.0), (T(6, 4, 5), 0, I(3, 4, 5), -2.0)])
register_examples("aten.scatter.src", [(T(32, 4), 1, I(32, 2), T(32, 2))])
register_examples("aten.repeat.default", [(T(32, 6), [4, 1]), (T(4, 6), [2, 1, 3]), (T(4, 6), [1, 1])])
register_examples("aten.reshape_as.default", [(T(4, 4, 8, 8, 2), T(4, 4, 8, 16)), (T(4, 6), T(24))])
register_examples("aten.view_as.default", [(T(4, 2, 3), T(4, 6))])
register_examples("aten.view_as_complex.default", [(T(4, 8, 4, 8, 2),)])
register_examples("aten.view_as_real.default", [(T(4, 8, 4, 8, dtype=torch.complex64),)])
