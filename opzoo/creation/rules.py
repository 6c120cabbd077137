"""Rules for tensors made from nothing or from another tensor's metadata, and for metadata checks.

* creators with no tensor input (``arange``, ``zeros``, ``ones``, ``full``, ``empty``, ``scalar_tensor``)
  have frozen output dims: every rank builds the whole (small) tensor locally, so a consumer that
  splits it slices its own piece, with no communication; ``empty`` is run as ``zeros`` (any value
  is a valid ``empty``, and verification needs one value);
* ``new_ones``/``new_zeros``/``new_full``/``new_empty`` read only their ``self``'s dtype and device:
  ``self`` becomes a ``?`` argument (it is not fetched at all) and the output dims are frozen;
* ``*_like`` ops follow their input's layout (``a b -> a b``): the output at a position depends
  only on that position's existence;
* ``type_as`` is a cast to the other tensor's dtype: ``a b, ? -> a b`` with the dtype as the ``?``;
* ``_assert_tensor_metadata`` (left by every ``.to(dtype)``) is a no-op on the input's layout:
  ``a b, ? .. -> a b``, run as :func:`assert_dtype`, which checks the dtype only (sizes and strides
  are those of the whole tensor, not of a shard) and returns its input.
"""
from __future__ import annotations

from functools import partial

import torch

from nnscaler.ops import OpCall, Size, TensorMeta, annotation_rule

from ..rulekit import Names, build, usable

FAMILY = "creation"
_NO_INPUT = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.zeros.default",
             "aten.ones.default", "aten.full.default", "aten.empty.memory_format", "aten.scalar_tensor.default")
_NEW = {"aten.new_ones.default": 1, "aten.new_zeros.default": 0, "aten.new_empty.default": 0,
        "aten.new_full.default": None}
_LIKE = {"aten.zeros_like.default": 0, "aten.ones_like.default": 1, "aten.empty_like.default": 0,
         "aten.full_like.default": None}


def _frozen(names: Names, shape) -> tuple[list[str], dict[str, int]]:
    dims, sizes = [], {}
    for n in shape:
        d = names.dim(n)
        if d != "1":
            sizes[d] = n
            d += "^"
        dims.append(d)
    return dims, sizes


def empty_as_zeros(size, *args, **kwargs):
    """``aten.empty.memory_format`` with a defined value: zeros of the same size and options."""
    kwargs.pop("memory_format", None)
    return torch.zeros(size, *args, **kwargs)


@annotation_rule(*_NO_INPUT)
def creator_rule(call: OpCall):
    """``?, ? -> a^``: made whole on every rank (its consumers slice their piece locally)."""
    out = call.outputs[0] if len(call.outputs) == 1 else None
    if not isinstance(out, TensorMeta) or not usable(call) or any(isinstance(a, TensorMeta) for a in call.args):
        return None
    dims, sizes = _frozen(Names(), out.shape)
    fn = empty_as_zeros if call.overload == "aten.empty.memory_format" else None
    return build(call, FAMILY, {}, [dims], sizes=sizes, fn=fn, differentiable=False)


def new_filled(ignored, size, fill_value=None, *, fill, dtype, **options):
    """``self.new_*(size)`` with ``self`` replaced by its dtype: ``torch.full`` of ``fill`` (or the
    call's ``fill_value`` where ``fill`` is None)."""
    options.pop("memory_format", None)
    options.pop("layout", None)
    value = fill_value if fill is None else fill
    size = [size] if isinstance(size, int) else list(size)  # a one-dim Size resolves to its length
    return torch.full(size, value, dtype=dtype, **{k: v for k, v in options.items() if k != "dtype"})


@annotation_rule(*_NEW)
def new_rule(call: OpCall):
    """``?, ? -> a^`` with ``self`` as a ``?`` (only its dtype matters); of ``self``'s own shape
    (``labels.new_zeros(labels.shape)``), ``a b, ? -> a b`` like ``zeros_like``, the size following
    the local lengths, so the result is split as ``self`` is and writes into it stay split."""
    out = call.outputs[0] if len(call.outputs) == 1 else None
    if not isinstance(out, TensorMeta) or not usable(call, empty_ok=True):  # (an empty self: only its dtype is read)
        return None
    x = call.args[0]
    if isinstance(x, TensorMeta) and x.ndim and tuple(x.shape) == tuple(out.shape):
        names = Names()
        dims = [names.dim(n) for n in x.shape]
        fn = partial(new_filled, fill=_NEW[call.overload], dtype=out.dtype)
        return build(call, FAMILY, {0: dims}, [dims], args={1: Size(" ".join(dims))}, fn=fn, differentiable=False)
    dims, sizes = _frozen(Names(), out.shape)
    fn = partial(new_filled, fill=_NEW[call.overload], dtype=out.dtype)
    return build(call, FAMILY, {}, [dims], args={0: None}, sizes=sizes, fn=fn, differentiable=False)


def like_filled(x, fill_value=None, *, fill, **options):
    """``*_like(x)`` (``empty_like`` as zeros): ``torch.full_like`` of ``fill`` or ``fill_value``."""
    options.pop("memory_format", None)
    return torch.full_like(x, fill_value if fill is None else fill, **options)


@annotation_rule(*_LIKE)
def like_rule(call: OpCall):
    """``a b -> a b``: the output follows its input's layout."""
    if not usable(call) or not call.args or not isinstance(call.args[0], TensorMeta):
        return None
    names = Names()
    dims = [names.dim(n) for n in call.tensor(0).shape]
    fn = partial(like_filled, fill=_LIKE[call.overload])
    return build(call, FAMILY, {0: dims}, [dims], fn=fn, differentiable=False)


def cast_to(x, dtype):
    """``x.type_as(other)`` with ``other`` replaced by its dtype."""
    return x.to(dtype)


@annotation_rule("aten.type_as.default")
def type_as_rule(call: OpCall):
    """``a b, ? -> a b``: a cast; the other tensor is not fetched, only its dtype is used."""
    if not usable(call) or not isinstance(call.args[1], TensorMeta):
        return None
    names = Names()
    dims = [names.dim(n) for n in call.tensor(0).shape]
    return build(call, FAMILY, {0: dims}, [dims], args={1: call.args[1].dtype}, fn=cast_to)


def assert_dtype(x, size=None, stride=None, dtype=None, device=None, layout=None):
    """``aten._assert_tensor_metadata`` on a shard: the dtype is checked, sizes and strides (the
    whole tensor's) are not; returns ``x`` so the check has an output to verify."""
    if dtype is not None and x.dtype != dtype and not (x.is_floating_point() and dtype.is_floating_point):
        # (the harness runs float ops in float64 too: a float is a float)
        raise AssertionError(f"tensor has dtype {x.dtype}, expected {dtype}")
    return x


@annotation_rule("aten._assert_tensor_metadata.default")
def assert_metadata_rule(call: OpCall):
    """``a b, ? .. -> a b``: a no-op that takes its input as it is laid out."""
    if not usable(call) or not call.args or not isinstance(call.args[0], TensorMeta):
        return None
    names = Names()
    dims = [names.dim(n) for n in call.tensor(0).shape]
    return build(call, FAMILY, {0: dims}, [dims], fn=assert_dtype)
