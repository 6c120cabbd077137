"""A model's unregistered ``torch.autograd.Function``s made leaves: one operator each, with the
``Function``'s own backward and an annotation inferred by probing.

``torch.export`` would inline a ``Function``'s forward and drop its backward (:mod:`.functions`). Where
the user has not registered one, :func:`make_leaves` records its calls in one eager forward of the
model on the sample arguments, infers an annotation from the first call and registers the class with
:func:`nnscaler.register_op` (its ``apply`` becomes a custom op whose backward is the ``Function``'s),
so the retrace keeps it as one node; an ATen operator no rule annotates is probed alike
(:func:`infer_rule`). The inference (:func:`infer_annotation`) names each dim of the first output and
the dims of the inputs matched with it; a dim stays splittable only if the probe finds that running
the operator on the two halves of the inputs along it and concatenating gives the whole output and,
for a random output gradient, the whole input gradients (halves concatenated where the input has the
dim, summed where it does not); an input's own dim splits by value (``+``) where the halves' outputs
add up to the whole; every other dim is frozen (``^``). An inferred annotation is said in one warning and its family is
``inferred``; the harness verifies the programs that use it like any other."""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import torch

from ..ops.lint import AnnotationWarning
from .functions import applied_function, user_functions

FAMILY = "inferred"
MAX_CALLS = 16  # calls recorded per Function: enough to see whether their constant arguments differ
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def unregistered(graph: torch.fx.Graph) -> dict[type, str]:
    """The unregistered ``Function`` classes whose forward made nodes of ``graph``, in graph order,
    each with the ``file:line`` of the model that first applies it."""
    functions = user_functions()
    out: dict[type, str] = {}
    for node in graph.nodes if functions else ():
        if node.op == "call_function":
            found = applied_function(node, functions)
            if found and found[0] not in out:
                out[found[0]] = found[1]
    return out


def _record(model: torch.nn.Module, args: Sequence[Any], kwargs: dict, classes: list[type]) -> dict[type, list]:
    """Each class's calls (their arguments, tensors cloned) in one eager forward under ``no_grad``."""
    calls: dict[type, list] = {c: [] for c in classes}
    saved = {c: c.__dict__.get("apply") for c in classes}

    def recorder(cls, original):
        def apply(*a):
            if len(calls[cls]) < MAX_CALLS:
                calls[cls].append([x.detach().clone() if isinstance(x, torch.Tensor) else x for x in a])
            return original(*a)
        return apply

    try:
        for c in classes:
            c.apply = recorder(c, c.apply)
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for c in classes:
            if saved[c] is None:
                del c.apply
            else:
                c.apply = saved[c]
    return calls


def _align(shape: Sequence[int], ref: Sequence[int]) -> dict[int, int]:
    """Each dim of ``shape`` (longer than 1) matched with a dim of ``ref`` of its length: right-aligned
    as broadcasting aligns them where that matches every such dim, else in order (a reduction drops
    dims); the rest are the tensor's own."""
    n, m = len(shape), len(ref)
    right = {j: j - n + m for j in range(n) if shape[j] > 1 and 0 <= j - n + m < m and shape[j] == ref[j - n + m]}
    if all(shape[j] == 1 or j in right for j in range(n)):
        return right
    out, k = {}, 0
    for j, length in enumerate(shape):
        q = next((q for q in range(k, m) if ref[q] == length), None) if length > 1 else None
        if q is not None:
            out[j], k = q, q + 1
    return out


def _probe(fn: Callable, call: list, dims: list[int | None], k: int | None) -> bool:
    """Whether splitting each tensor argument along ``dims`` (None: whole) in two halves gives the
    whole: the halves' outputs concatenated along ``k`` (``k`` None: summed, a split by value) and,
    for a random output gradient, the halves' input gradients concatenated where split, summed where
    not (see the module docstring)."""
    pos = [i for i, x in enumerate(call) if isinstance(x, torch.Tensor)]
    xs = [call[i] for i in pos]
    if not any(d is not None for d in dims):
        return False

    def run(parts):
        a = list(call)
        leaves = []
        for i, t in zip(pos, parts):
            t = t.detach().clone().requires_grad_(t.is_floating_point())
            leaves.append(t)
            a[i] = t
        out = fn(*a)
        return leaves, list(out) if isinstance(out, (tuple, list)) else [out]

    try:
        leaves, whole = run(xs)
        if not all(o.shape == whole[0].shape for o in whole):
            return False
        gen = torch.Generator().manual_seed(0 if k is None else k + 1)
        grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point() else None for o in whole]
        try:
            want = _grads(whole, leaves, grads)
        except RuntimeError:  # no backward (heaviside): the forward alone decides
            want, grads = None, [None] * len(whole)
        got_out, got_grad = [[] for _ in whole], [[] for _ in leaves]
        for h in range(2):
            parts = [x.chunk(2, d)[h] if d is not None else x for x, d in zip(xs, dims)]
            pl, po = run(parts)
            for i, o in enumerate(po):
                got_out[i].append(o)
            gk = [(g.chunk(2, k)[h] if k is not None else g) if g is not None else None for g in grads]
            for i, g in enumerate(_grads(po, pl, gk) if want is not None else []):
                got_grad[i].append(g)
        for w, parts in zip(whole, got_out):
            if not _close(torch.cat(parts, k) if k is not None else parts[0] + parts[1], w):
                return False
        for w, parts, d in zip(want or [], got_grad, dims):
            if w is None or any(p is None for p in parts):
                if not (w is None and all(p is None for p in parts)):
                    return False
                continue
            if not _close(torch.cat(parts, d) if d is not None else parts[0] + parts[1], w):
                return False
        return True
    except Exception:  # noqa: BLE001  (a probe that fails to run keeps the dim whole)
        return False


def _grads(outs, leaves, grads):
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wanted = [t for t in leaves if t.requires_grad]
    if not pairs or not wanted:
        return [None] * len(leaves)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    return [next(got) if t.requires_grad else None for t in leaves]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    tol = 64 * torch.finfo(a.dtype).eps
    scale = b[b.isfinite()].abs().max().item() if b.isfinite().any() else 1.0
    return bool(torch.allclose(a.double(), b.double(), rtol=tol, atol=tol * max(1.0, scale), equal_nan=True))


def infer_annotation(fn: Callable, call: list) -> str:
    """The annotation of ``fn`` at ``call`` (its positional arguments): every dim of the inputs and
    outputs matched with a dim of the first output (:func:`_align`) and splittable where
    :func:`_probe` finds the halves give the whole; an input's own dims (no output has them) split
    by value (``+``) where the halves' outputs add up to the whole, dims of one length across inputs
    together (a contraction); every other dim frozen (``^``); ``?`` for arguments other than tensors."""
    with torch.no_grad():
        out = fn(*call)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise ValueError("it returns something other than tensors")
    ref = tuple(outs[0].shape)
    xs = [x for x in call if isinstance(x, torch.Tensor)]
    maps = [_align(tuple(x.shape), ref) for x in xs]
    names = []
    for k in range(len(ref)):
        dims = [next((j for j, q in mp.items() if q == k), None) for mp in maps]
        names.append(_LETTERS[k] + ("" if ref[k] > 1 and _probe(fn, call, dims, k) else "^"))
    own: dict[tuple[int, int], str] = {}  # (tensor, dim) -> name of a dim no output has
    fresh = iter(_LETTERS[len(ref):] + "".join(f"z{i}" for i in range(100)))  # z0.. never clash with a..y
    floating = all(o.is_floating_point() for o in outs)
    by_length: dict[int, list[tuple[int, int]]] = {}
    for i, (x, mp) in enumerate(zip(xs, maps)):
        for j, length in enumerate(x.shape):
            if j not in mp and length > 1:
                by_length.setdefault(length, []).append((i, j))
    for length, members in by_length.items():
        def summed(group):
            dims = [dict(group).get(i) for i in range(len(xs))]
            return floating and len({i for i, _ in group}) == len(group) and _probe(fn, call, dims, None)
        if len(members) > 1 and summed(members):
            shared = f"{next(fresh)}+"
            own.update({m: shared for m in members})
            continue
        for m in members:
            own[m] = f"{next(fresh)}{'+' if summed([m]) else '^'}"

    def text(t: torch.Tensor, i: int | None) -> str:
        mp = maps[i] if i is not None else ({j: j for j in range(len(ref))} if tuple(t.shape) == ref else {})
        dims = [names[mp[j]] if j in mp else "1" if n == 1 else own.get((i, j)) or f"{next(fresh)}^"
                for j, n in enumerate(t.shape)]
        return " ".join(dims) if dims else "1"

    which = iter(range(len(xs)))
    ins = [text(x, next(which)) if isinstance(x, torch.Tensor) else "?" for x in call]
    return f"{', '.join(ins)} -> {', '.join(text(o, None) for o in outs)}"


def make_leaves(model: torch.nn.Module, args: Sequence[Any], kwargs: dict, classes: dict[type, str]) -> str | None:
    """Register each of ``classes`` (class -> the model's ``file:line`` applying it) as a leaf with an
    inferred annotation (one warning each, at that line); the refusal for the first that cannot be
    (None when all could)."""
    calls = _record(model, args, kwargs, list(classes))
    for cls, where in classes.items():
        name = f"{cls.__module__}.{cls.__qualname__}"
        seen = calls[cls]
        if not seen:
            return f"{name} is a torch.autograd.Function the sample forward never applied"
        constants = [tuple(x for x in c if not isinstance(x, torch.Tensor)) for c in seen]
        if any(c != constants[0] for c in constants) or any(len(c) != len(seen[0]) for c in seen):
            return (f"{name} is a torch.autograd.Function applied with different non-tensor arguments "
                    f"({constants[0]} and {next(c for c in constants if c != constants[0])}): one inferred "
                    f"operator cannot fix them; register it with @nnscaler.register_op(\"<annotation>\") on the class")
        try:
            anno = _leaf(cls, seen[0], name)
        except Exception as exc:  # noqa: BLE001  (the refusal says why)
            return (f"{name} is a torch.autograd.Function whose annotation could not be inferred "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); register it with "
                    f"@nnscaler.register_op(\"<annotation>\") on the class (it then stays one operator with its "
                    f"own backward)")
        path, _, line = where.rpartition(":")
        warnings.warn_explicit(f"{name}: a torch.autograd.Function traced as one operator with its own backward, "
                               f"annotation inferred by probing: {anno!r} (register it with @nnscaler.register_op "
                               f"to choose another)", AnnotationWarning, path, int(line) if line.isdigit() else 0)
    return None


def _leaf(cls: type, call: list, name: str) -> str:
    """Make ``cls`` one custom op of its tensor arguments, its other arguments (the same in every
    call: checked by the caller) baked in, so any constant works (a config object, None); its
    ``apply`` takes the full argument list as before. Returns the inferred annotation."""
    from ..ops.registry import register_op
    original, n = cls.apply, len(call)
    const = {i: x for i, x in enumerate(call) if not isinstance(x, torch.Tensor)}

    def core(*tensors):
        it = iter(tensors)
        return original(*[const[i] if i in const else next(it) for i in range(n)])

    anno = infer_annotation(core, [x for x in call if isinstance(x, torch.Tensor)])
    op = register_op(anno, name=name, family=FAMILY)(core)
    cls.apply = lambda *a: op(*[x for x in a if isinstance(x, torch.Tensor)])
    cls._nnscaler_custom_op = op
    return anno


PROBE_ELEMENTS = 2**20  # the largest tensor an operator is probed on (a meta-device trace for a cluster plan is not)


def _differentiable(op, sample: list, kwargs: dict) -> bool:
    """Whether autograd connects any output of ``op`` to its tensor inputs (``new_zeros`` reads only
    its input's dtype: its output carries no gradient, and a parameter read only through it gets none)."""
    args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in sample]
    with torch.enable_grad():
        out = op(*args, **kwargs)
    return any(isinstance(o, torch.Tensor) and o.requires_grad for o in (out if isinstance(out, (tuple, list)) else [out]))


def infer_rule(call):
    """The spec of an ATen call no rule or entry annotates, its annotation inferred by probing it on
    random inputs of the call's shapes (:func:`infer_annotation`; family ``inferred``); None where a
    probe cannot stand for it: a tensor list, an integer or boolean tensor (its values would be
    guesses), a tensor over :data:`PROBE_ELEMENTS`, an op that writes in place or draws random numbers,
    an output that is not a tensor."""
    from ..ops.rules import TensorMeta, aten_overload
    from ..ops.spec import OpSpec
    try:
        op = aten_overload(call.overload)
    except KeyError:
        return None
    if op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags:
        return None
    metas = [a for a in call.args if isinstance(a, TensorMeta)]
    if not metas or any(isinstance(a, (list, tuple)) and any(isinstance(x, TensorMeta) for x in a) for a in call.args):
        return None
    if any(not m.dtype.is_floating_point or math.prod(m.shape) > PROBE_ELEMENTS for m in metas) \
            or not call.outputs or any(not isinstance(o, TensorMeta) for o in call.outputs):
        return None
    gen = torch.Generator().manual_seed(0)
    sample = [torch.randn(a.shape, generator=gen, dtype=a.dtype) if isinstance(a, TensorMeta) else a
              for a in call.args]
    kwargs = dict(call.kwargs)
    try:
        anno = infer_annotation(lambda *a: op(*a, **kwargs), sample)
        return OpSpec.create(f"inferred.{call.overload.removeprefix('aten.')}", anno, op,
                             args={i: a for i, a in enumerate(call.args) if not isinstance(a, TensorMeta)},
                             kwargs=kwargs, family=FAMILY, aten=(call.overload,),
                             differentiable=_differentiable(op, sample, kwargs))
    except Exception:  # noqa: BLE001  (no annotation: the operator stays unknown, replicated and named)
        return None
