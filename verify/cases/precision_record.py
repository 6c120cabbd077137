"""The recipe's precision checked structurally (DESIGN.md's precision contract): what dtype the program
really reduced, sent and computed in, against what a ``bf16-mixed`` recipe promises. A narrower
gradient reduction or stage transfer stays inside the bf16 bound, so no numeric comparison sees it.

:class:`PrecisionRecord`, entered around the program's own step (its forward, backward and gradient
sync), records every collective of :mod:`torch.distributed` by the runtime file that called it
(``grad_sync.py``: a gradient all-reduce of bucket i; ``zero.py``: ZeRO's gradient reduce-scatter;
torch's pipelining: a stage transfer; ``collectives.py``: a layout conversion, recorded only), and
every call of autocast's float32 operators (:func:`autocast_fp32_ops`, learnt on this device); its
:meth:`~PrecisionRecord.watch` records the optimizer step's arithmetic. :meth:`~PrecisionRecord.checks`
then compares them with the promises: gradients reduced in float32 unless ``grad_reduce_dtype="bf16"``,
master weights, optimizer state and its arithmetic in float32, autocast's float32 operators in float32,
stage transfers in their traced dtype, the loss no narrower than the single-device run's. A narrower
place is a failing check named for it (``precision: gradient all-reduce of bucket 0 in bfloat16, the
recipe promises float32``). Only a ``bf16-mixed`` recipe is recorded (the only one promising a dtype
wider than its compute); under any other the record does nothing and adds no check."""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nnscaler.recipe import Recipe
from nnscaler.trace import amp

from verify.judge.compare import Check

COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "all_gather_into_tensor",
               "all_gather_single", "all_to_all_single", "all_gather", "send", "recv", "broadcast")
# (isend and irecv stay torch's own: ``P2POp`` refuses any other op; its tensors are recorded instead)
# the runtime file a collective is called from -> (its place, whether it reduces gradients)
_ORIGINS = {"grad_sync.py": ("gradient {fn} of bucket {i}", True),
            "zero.py": ("ZeRO gradient {fn} of bucket {i}", True),
            "zero3.py": ("ZeRO 3 {fn}", False),
            "pipeline.py": ("pipeline {fn}", False),
            "collectives.py": ("layout conversion {fn}", False),
            "clip.py": ("gradient-norm {fn}", False),
            "microbatch.py": ("loss {fn}", False),
            "merge.py": ("checkpoint {fn}", False),
            "ring.py": ("ring exchange {fn}", False)}
_GRADIENT_FNS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _narrower(got: torch.dtype, want: torch.dtype) -> bool:
    """Whether floating ``got`` holds fewer mantissa bits than ``want``."""
    return got.is_floating_point and want.is_floating_point and torch.finfo(got).eps > torch.finfo(want).eps


def _floating(args) -> list[torch.Tensor]:
    return [a for a in tree_leaves(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]


@functools.cache
def autocast_fp32_ops(device_type: str = "cpu") -> frozenset[str]:
    """The aten operators that ``torch.autocast(device_type, bfloat16)`` always runs in float32 on this
    device: each function of a small battery (losses, softmaxes, norms) run under autocast on bf16
    inputs; an operator that ever received a bf16 input there is left out (on CPU ``_log_softmax``
    computes in float32 under ``cross_entropy`` but in bf16 when called itself), and so is one that autocast
    leaves in bf16 in plain arithmetic (the ``mul`` and ``mean`` a float32 loss decomposes into)."""
    x = torch.linspace(0.1, 0.9, 32, device=device_type).reshape(4, 8).to(torch.bfloat16)  # no draw: the
    t = torch.arange(4, device=device_type)  # program's random state stays as it was
    plain = [lambda: x * x, lambda: x - x, lambda: x + x, lambda: x / x, lambda: x.mean(), lambda: x.sum(),
             lambda: x.abs(), lambda: x.exp(), lambda: x.log(), lambda: x.pow(2), lambda: x.sqrt(),
             lambda: x.rsqrt(), lambda: torch.xlogy(x, x), lambda: x.tanh(), lambda: x.sigmoid(), lambda: x.amax(-1)]
    battery = [lambda: F.softmax(x, -1), lambda: F.log_softmax(x, -1), lambda: F.cross_entropy(x, t),
               lambda: F.nll_loss(x, t), lambda: F.mse_loss(x, x), lambda: F.l1_loss(x, x),
               lambda: F.smooth_l1_loss(x, x), lambda: F.binary_cross_entropy_with_logits(x, x.sigmoid()),
               lambda: F.kl_div(x, x, reduction="batchmean"), lambda: F.layer_norm(x, (8,)), lambda: F.group_norm(x.view(4, 8, 1), 2)]
    wide, narrow = set(), set()
    for fn in plain + battery:
        with torch.autocast(device_type, dtype=torch.bfloat16), _Calls() as calls:
            try:
                fn()
            except (RuntimeError, NotImplementedError):  # no bf16 kernel here: nothing learnt from it
                continue
        for op, dtypes in calls.seen:
            (narrow if torch.bfloat16 in dtypes else wide).add(op)
    return frozenset(wide - narrow - {"aten._to_copy.default"})


class _Calls(TorchDispatchMode):
    """Every aten call below autocast: its name and its floating inputs' dtypes."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen.append((str(func), tuple(a.dtype for a in _floating((args, kwargs)))))
        return func(*args, **kwargs)


class _Narrow(TorchDispatchMode):
    """Records the aten calls in ``ops`` (every call, when None) that read a floating input narrower
    than ``want`` into ``out`` (``{op: dtype}``, first seen)."""

    def __init__(self, ops: frozenset[str] | None, want: torch.dtype, out: dict):
        super().__init__()
        self.ops, self.want, self.out = ops, want, out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if self.ops is None or name in self.ops:
            for a in _floating((args, kwargs)):
                if _narrower(a.dtype, self.want):
                    self.out.setdefault(name, a.dtype)
                    break
        return func(*args, **kwargs)


@dataclass
class PrecisionRecord:
    """What a program under ``recipe`` computed in (module docstring); inactive unless ``bf16-mixed``."""

    recipe: Recipe = field(default_factory=Recipe)
    device_type: str = "cpu"
    places: dict = field(default_factory=dict)  # (place, gradient?) -> the narrowest dtype seen there
    transfers: dict = field(default_factory=dict)  # stage transfer -> the narrowest dtype seen
    autocast: dict = field(default_factory=dict)  # autocast's fp32 operator -> a narrower dtype it read
    optimizer_math: dict = field(default_factory=dict)  # optimizer-step operator -> a narrower dtype it read
    _undo: list = field(default_factory=list)
    _mode: TorchDispatchMode | None = None

    @classmethod
    def of(cls, recipe: Recipe, device_type: str = "cpu") -> "PrecisionRecord":
        return cls(recipe, device_type)

    @property
    def active(self) -> bool:
        return self.recipe.precision == "bf16-mixed"

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype the recipe promises gradients are reduced in."""
        return torch.bfloat16 if self.recipe.grad_reduce_dtype == "bf16" else torch.float32

    # -- recording ------------------------------------------------------------------------------------
    def __enter__(self) -> "PrecisionRecord":
        if not self.active:
            return self
        for fn in COLLECTIVES:
            orig = getattr(dist, fn, None)
            if orig is not None:
                self._undo.append((dist, fn, orig))
                setattr(dist, fn, self._wrap(fn, orig))
        p2p = dist.P2POp
        record = self

        class RecordedP2POp(p2p):  # torch's pipelining sends and receives through batched P2P ops
            def __init__(self, op, tensor, *args, **kwargs):
                super().__init__(op, tensor, *args, **kwargs)
                place = record._place("send" if op is dist.isend else "recv")
                if place[0].startswith("ring exchange"):  # ring attention's own rotation of keys and values:
                    record._note(place, tensor)  # activations in the compute dtype, judged as the program's
                else:
                    record._note(f"pipeline stage transfer ({'send' if op is dist.isend else 'recv'})", tensor,
                                 transfer=True)
        self._undo.append((dist, "P2POp", p2p))
        dist.P2POp = RecordedP2POp
        self._mode = _Narrow(autocast_fp32_ops(self.device_type), torch.float32, self.autocast)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        while self._undo:
            owner, name, orig = self._undo.pop()
            setattr(owner, name, orig)

    def _wrap(self, fn: str, orig):
        def recorded(*args, **kwargs):
            tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
            tensors += [t for a in args[:2] if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            if tensors:
                self._note(self._place(fn), tensors[-1] if fn in ("reduce_scatter_tensor", "reduce_scatter_single",
                                                                  "reduce_scatter", "all_gather_single")
                           else tensors[0],
                           gradient=fn in _GRADIENT_FNS)
            return orig(*args, **kwargs)
        return recorded

    def _place(self, fn: str) -> tuple[str, bool]:
        """The place a collective ``fn`` is called from (the first runtime file up the stack) and whether
        it reduces gradients; a bucket is named by its index in its owner's ``buckets``."""
        frame = sys._getframe(1)
        while frame is not None:
            path = frame.f_code.co_filename
            base = os.path.basename(path)
            if f"{os.sep}pipelining{os.sep}" in path:
                return "pipeline stage transfer", False
            if base in _ORIGINS and f"nnscaler{os.sep}runtime" in path:
                text, reduces = _ORIGINS[base]
                owner, b = frame.f_locals.get("self"), frame.f_locals.get("b")
                i = next((k for k, x in enumerate(getattr(owner, "buckets", ())) if x is b), "?")
                return text.format(fn=fn.replace("_", "-").removesuffix("-tensor").removesuffix("-single"), i=i), reduces
            frame = frame.f_back
        return f"{fn} (outside the runtime)", False

    def _note(self, place, tensor: torch.Tensor, gradient: bool = False, transfer: bool = False) -> None:
        if not tensor.is_floating_point():
            return
        book = self.transfers if transfer else self.places
        key = place if transfer else (place[0], place[1] and gradient)
        old = book.get(key)
        if old is None or _narrower(tensor.dtype, old):
            book[key] = tensor.dtype

    def watch(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``opt`` with its ``step`` recorded: every operator of it that reads a floating input narrower
        than float32 (the recipe's optimizer math)."""
        if not self.active:
            return opt
        step = opt.step

        def recorded(*args, **kwargs):
            with _Narrow(None, torch.float32, self.optimizer_math):
                return step(*args, **kwargs)
        opt.step = recorded
        return opt

    # -- judging --------------------------------------------------------------------------------------
    def checks(self, pm, opt: torch.optim.Optimizer | None = None, loss: torch.Tensor | None = None,
               reference_loss: torch.Tensor | None = None) -> list[Check]:
        """The precision checks of the recorded program ``pm`` and its optimizer ``opt``: one failing
        check per narrower place, else one passing ``precision: the recipe's dtypes`` (none when
        inactive). ``loss``: the program's, judged against the single-device run's ``reference_loss``."""
        if not self.active:
            return []
        bad: list[tuple[str, str]] = []
        for (place, gradient), dtype in self.places.items():
            if gradient and _narrower(dtype, self.reduce_dtype):
                bad.append((f"{place} in {_name(dtype)}", _name(self.reduce_dtype)))
        traced = stage_dtypes(pm)
        for place, dtype in self.transfers.items():
            if traced and dtype not in traced:
                bad.append((f"{place} in {_name(dtype)}",
                            f"the traced {' / '.join(sorted(_name(d) for d in traced))}"))
        bad += [(f"{op} (autocast's float32 operator) in {_name(d)}", "float32") for op, d in self.autocast.items()]
        bad += uncast_fp32_operators(pm, self.device_type)
        bad += [(f"optimizer math: {op} in {_name(d)}", "float32") for op, d in list(self.optimizer_math.items())[:1]]
        if opt is not None:
            bad += _optimizer_dtypes(opt)
        if loss is not None and reference_loss is not None and _narrower(loss.dtype, reference_loss.dtype):
            bad.append((f"the loss in {_name(loss.dtype)}", f"{_name(reference_loss.dtype)} (the single-device run's)"))
        if not bad:
            seen = len(self.places) + len(self.transfers)
            return [Check("precision: the recipe's dtypes", 0.0, 0.0, True,
                          f"{seen} collective places and transfers, autocast's float32 operators, the optimizer")]
        return [Check(f"precision: {what}, the recipe promises {want}", float("inf"), 0.0, False,
                      f"{what} where the {self.recipe.precision} recipe promises {want}") for what, want in bad]


def uncast_fp32_operators(pm, device_type: str = "cpu") -> list[tuple[str, str]]:
    """The operators of ``pm``'s program that autocast computes in float32 on one device (learnt afresh
    from the traced program by :func:`nnscaler.trace.amp.autocast_casts`, not from the compiled plan's
    marks) but that the program does not cast to float32: a partition-aware kernel (a vocabulary-parallel
    cross-entropy) computes in elementwise operators no aten-level record can tell from bf16 arithmetic."""
    graph = getattr(pm, "graph", None)
    exported = getattr(graph, "exported", None)
    if exported is None:
        return []
    truth, _ = amp.autocast_casts(exported, device_type, torch.bfloat16)
    bad = []
    for op in graph.ops:
        cast = getattr(op, "cast", None)
        if truth.get(op.name) == torch.float32 and cast not in (torch.float32, "autocast"):
            bad.append((f"{op.name} ({op.overload}, autocast's float32 operator) cast to "
                        f"{_name(cast) if isinstance(cast, torch.dtype) else 'nothing'}", "float32"))
    return bad


def stage_dtypes(pm) -> set[torch.dtype]:
    """The traced floating dtypes of a pipeline's stage boundaries (empty for a module with no stages)."""
    boundary = getattr(pm, "boundary_dtypes", None)
    return set(boundary()) if callable(boundary) else set()


def _optimizer_dtypes(opt: torch.optim.Optimizer) -> list[tuple[str, str]]:
    """Master weights (the tensors ``opt`` updates) and every floating tensor of its state narrower
    than float32, first of each."""
    bad = []
    params = [p for g in opt.param_groups for p in g["params"]]
    low = next((p for p in params if _narrower(p.dtype, torch.float32)), None)
    if low is not None:
        bad.append((f"master weights (the optimizer's parameters) in {_name(low.dtype)}", "float32"))
    for state in opt.state.values():
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and _narrower(v.dtype, torch.float32):
                return bad + [(f"optimizer state {key} in {_name(v.dtype)}", "float32")]
    return bad
