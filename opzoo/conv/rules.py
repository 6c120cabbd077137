"""Rules for convolutions, transposed convolutions and ``group_norm`` as real ``nn.Conv1d/2d`` and ``nn.GroupNorm`` trace
them (``padding``/``stride`` as lists, ``cudnn_enabled`` given), any batch and spatial rank.

* ``conv1d``/``conv2d``/``conv3d`` (``groups == 1``): ``n c+ h^ w^, o c+ kh^ kw^, o -> n o ho^ wo^``:
  batch and output channels spatial, input channels split by value (the bias is then held by one
  rank), the spatial extents frozen (a split would need halos); grouped and depthwise convolutions
  split by group; ``padding="same"`` (the ``.padding`` overloads) alike;
* ``conv_transpose1d/2d/3d`` alike, the weight being ``c o kh^ kw^`` (input channels first);
* pooling (``avg_pool``, ``max_pool``, ``adaptive_avg_pool`` 1d/2d/3d): ``n c h^ w^ -> n c ho^ wo^``,
  each channel of each sample pooled on its own (the window's extents frozen);
* ``group_norm``: ``n (g c) h^ w^, ?, (g c), (g c), ?, ? -> n (g c) h^ w^`` with ``num_groups``
  ``Size("g")``: a rank normalises whole groups; one group (``g == 1``) freezes the channels.
"""
from __future__ import annotations

from nnscaler.ops import OpCall, Size, TensorMeta, annotation_rule

from ..rulekit import Names, arg, build, frozen_dim, mark, usable

FAMILY = "nn"


@annotation_rule("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
                 "aten.conv1d.padding", "aten.conv2d.padding", "aten.conv3d.padding")
def conv_rule(call: OpCall):
    """``groups == 1``: ``n c+ h^ w^, o c+ kh^ kw^, +o, ? .. -> n o ho^ wo^``; ``groups == g > 1``:
    ``n (g c) h^, (g o) c kh^, (g o), ? .. -> n (g o) ho^`` (``c``, ``o`` the channels per group, fixed
    counts; a rank convolves whole groups, ``groups`` follows as ``Size("g")``). ``padding`` may be a
    list or a string (``"same"``, the ``.padding`` overloads)."""
    if not usable(call):
        return None
    x, w = call.tensor(0), call.tensor(1)
    groups = arg(call, 6, "groups", 1)
    if not isinstance(groups, int) or w.ndim != x.ndim or x.ndim < 3 or w.shape[1] * groups != x.shape[1] \
            or w.shape[0] % groups:
        return None
    names = Names()
    if groups == 1:
        c, o = mark(names.dim(x.shape[1], "c"), "+"), names.dim(w.shape[0], "o")
        # the bias is added after the contraction over c: partial under a c split (one input channel: no split)
        return _convolution(call, names, c, [o, c], o, "+" + o if c.endswith("+") else o)
    g = names.new("g")
    per_in, per_out = w.shape[1], w.shape[0] // groups
    o = g if per_out == 1 else f"({g} {per_out})"
    return _convolution(call, names, g if per_in == 1 else f"({g} {per_in})", [o, str(per_in)], o, o, g)


@annotation_rule("aten.group_norm.default")
def group_norm_rule(call: OpCall):
    """``n (g c) h^, ?, (g c), (g c), ?, ? -> n (g c) h^`` with ``num_groups`` ``Size("g")``."""
    if not usable(call):
        return None
    x, groups = call.tensor(0), call.args[1]
    if x.ndim < 2 or not isinstance(groups, int) or groups < 1 or x.shape[1] % groups:
        return None
    names, sizes = Names(), {}
    n = names.dim(x.shape[0], "n")
    per = x.shape[1] // groups
    args = {}
    if groups == 1:
        ch = frozen_dim(names, x.shape[1], sizes)
    elif per == 1:
        ch = names.new("g")
        args[1] = Size(ch)
    else:
        g = names.new("g")
        ch = f"({g} {per})"  # the channels per group, a fixed count
        args[1] = Size(g)
    din = [n, ch] + [frozen_dim(names, s, sizes) for s in x.shape[2:]]
    ins = {0: din}
    for pos in (2, 3):
        t = call.args[pos] if len(call.args) > pos else call.kwargs.get(("weight", "bias")[pos - 2])
        if isinstance(t, TensorMeta):
            ins[pos] = [ch]
    return build(call, FAMILY, ins, [din], args=args, sizes=sizes)


@annotation_rule("aten.conv_transpose1d.default", "aten.conv_transpose2d.input", "aten.conv_transpose3d.input")
def conv_transpose_rule(call: OpCall):
    """Transposed convolutions (the weight is ``in, out/groups, k..``): ``groups == 1``:
    ``n c+ h^ w^, c+ o kh^ kw^, +o, ? .. -> n o ho^ wo^`` (input channels split by value, output
    channels and batch spatial); ``groups == g > 1``: ``n (g c), (g c) o k^, (g o), ? .. -> n (g o) ho^``
    (a rank convolves whole groups; ``groups`` follows as ``Size("g")``). Spatial extents frozen."""
    if not usable(call):
        return None
    x, w = call.tensor(0), call.tensor(1)
    groups = arg(call, 6, "groups", 1)
    if not isinstance(groups, int) or w.ndim != x.ndim or x.ndim < 3 or w.shape[0] != x.shape[1] \
            or x.shape[1] % groups:
        return None
    names = Names()
    per_in, per_out = x.shape[1] // groups, w.shape[1]
    if groups == 1:
        c, o = mark(names.dim(x.shape[1], "c"), "+"), names.dim(per_out, "o")
        return _convolution(call, names, c, [c, o], o, "+" + o if o != "1" else o)
    g = names.new("g")
    cin = g if per_in == 1 else f"({g} {per_in})"
    o = g if per_out == 1 else f"({g} {per_out})"
    return _convolution(call, names, cin, [cin, str(per_out)], o, o, g)


def _convolution(call: OpCall, names: Names, cin: str, weight: list[str], o: str, bias_dim: str, g: str | None = None):
    """The annotation of a (transposed) convolution whose channel dims are named: input ``n cin
    spatial^``, weight ``weight kernel^``, bias ``bias_dim``, output ``n o spatial^``; with groups
    ``g``, ``groups`` follows as ``Size(g)``."""
    x, w, out = call.tensor(0), call.tensor(1), call.outputs[0]
    sizes: dict = {}
    n = names.dim(x.shape[0], "n")
    args, kwargs = {}, dict(call.kwargs)
    if g is not None:
        if len(call.args) > 6:
            args[6] = Size(g)
        else:
            kwargs["groups"] = Size(g)
    ins = {0: [n, cin] + [frozen_dim(names, s, sizes) for s in x.shape[2:]],
           1: weight + [frozen_dim(names, s, sizes) for s in w.shape[2:]]}
    bias = call.args[2] if len(call.args) > 2 else call.kwargs.get("bias")
    if isinstance(bias, TensorMeta):
        ins[2] = [bias_dim]
    return build(call, FAMILY, ins, [[n, o] + [frozen_dim(names, s, sizes) for s in out.shape[2:]]], sizes=sizes,
                 args=args, kwargs=kwargs)


POOLS = {f"aten.{kind}_pool{d}d.default": d for kind in ("avg", "max", "adaptive_avg") for d in (1, 2, 3)}


@annotation_rule(*POOLS)
def pool_rule(call: OpCall):
    """``n c h^ w^, ? .. -> n c ho^ wo^`` (batched inputs: batch, channels, ``d`` spatial dims)."""
    if not usable(call) or len(call.outputs) != 1:
        return None
    x, out = call.tensor(0), call.outputs[0]
    if x.ndim != POOLS[call.overload] + 2 or out.ndim != x.ndim or tuple(out.shape[:2]) != tuple(x.shape[:2]):
        return None
    names, sizes = Names(), {}
    n, c = names.dim(x.shape[0], "n"), names.dim(x.shape[1], "c")
    return build(call, FAMILY, {0: [n, c] + [frozen_dim(names, s, sizes) for s in x.shape[2:]]},
                 [[n, c] + [frozen_dim(names, s, sizes) for s in out.shape[2:]]], sizes=sizes)
