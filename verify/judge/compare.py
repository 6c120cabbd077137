"""The tolerance policy, stated once.

For every compared tensor (each output, and the gradient of each floating input) there are three
versions: the parallel result ``par`` (in the dtype under test), the single-device result ``dev``
(same dtype) and the single-device float64 result ``ref``. With ``err(x) = max |x - ref|`` over the
finite elements of ``ref``:

    pass  iff  err(par) <= FACTOR * err(dev) + FLOOR_EPS * eps(dtype) * max|ref|

* ``FACTOR = 4``: a parallel program may reorder sums, so it may lose a little more than one device,
  but not orders of magnitude more.
* ``FLOOR_EPS = 16``: where one device happens to be exact (``err(dev) == 0``), a reordered sum still
  may round; sixteen units in the last place of the largest value allow for that. eps is 2.2e-16
  (float64), 1.2e-7 (float32), 9.8e-4 (float16), 7.8e-3 (bfloat16).
* ``PARTIAL_EPS = 2``: an operator output summed from partial values (a split by value, ``+``) is
  rounded per partial and per addition in its dtype; where the partials cancel (a bf16 sum of 4096
  values near zero) that error is set by the partials, not by ``max|ref|``. Such an output's bound
  gains ``PARTIAL_EPS * eps(dtype) * sum over ranks of max|partial|`` (op cases; each rank's
  partial magnitude is summed over the value-split group). A wrong split is off by whole partials.
* Positions where ``ref`` is NaN or infinite must be the same NaN/inf in ``par``; a NaN or inf in
  ``par`` where ``ref`` is finite fails, whatever the numbers.
* Integer and boolean tensors must be equal; shapes and dtypes must match. ``None`` (no gradient)
  passes only where all three versions are ``None``: a missing gradient where the float64 reference
  has one fails, even if the single-device run in the test dtype lost it too.

Whole models (``verify/cases/model.py``) train with AdamW, whose update ``lr * m / (sqrt(v) + eps)`` is
scale-invariant (a gradient off by a constant factor moves no parameter) and divides rounding noise of
near-zero gradients by their own tiny ``sqrt(v)`` (noise of 1e-9 becomes an update of a whole ``lr``).
Comparing parameters after several steps therefore proves little and needs a bound as large as the
learning rate. Instead each step is judged in two separate parts, so that errors cannot compound:

1. **Gradients at the reference point.** Before each step the single-device run's parameters are
   loaded into the parallel module (and, upcast, into the float64 model), so all three compute the
   loss and every gradient at the same parameters; both are judged by the rule above. The floor of
   a gradient uses the largest gradient of the step (``scale``) instead of its own ``max|ref|``: a
   gradient that vanishes in exact arithmetic (a key bias under softmax) is rounding noise of terms
   as large as the others. Gradient-scale bugs, which Adam would hide, fail here.
2. **The update, by rounding alone.** The parallel optimizer's step is compared with AdamW applied on
   one device to the parallel run's own (whole, already judged) gradients from the same parameters
   and the same optimizer history: the same elementwise arithmetic on a shard as on the whole, so per
   element ``|par - want| <= UPDATE_EPS * eps * (|want| + lr)`` (a few units in the last place of the
   parameter and of the update, which is at most about ``lr`` in size) — see :func:`check_update`.

A wrong partition, collective or shard offset gives errors of the order of the values themselves; a
single-rank perturbation of 1e-4 relative in an activation, a gradient bucket or a parameter shard is
still three or more orders above rounding in float32 (``tests/harness/test_model_verdict.py`` proves both).
Measured (``bench/verdicts/verdict_calibration.py``, ``bench/results/verdict_calibration.md``): over ten
architectures (GPT, Llama, Gemma, Qwen3, Phi-3, T5, ViT, a GroupNorm ResNet, batched Mixtral, the
TransformerEncoder), widths 32 to 256, 10 seeds, 3 steps, ``dp`` and ``tp`` at W=2, the worst check of
a correct program stays below 40% of its bound (806 cases, worst err/tol 0.378); the 1e-4
single-rank perturbations of the verdict tests exceed theirs 50- to 66-fold on the gradients (3-4-fold
on the loss). No constant was changed for it.

**Low precision (bf16 recipes, ``verify model --precision bf16-mixed|bf16-true``).** The parallel
program is compared with the single-device run of the same recipe (``dev``: the model under
``torch.autocast(device, bfloat16)``, or cast to bf16), per tensor in the Frobenius norm, the bound
being the measured spread of correct programs on that very tensor:

    pass  iff  ||par - dev||_F <= LOWPREC_FACTOR * ||dev - ref||_F + LOWPREC_FLOOR * eps(bf16) * ||ref||_F

``||dev - ref||_F`` is what a correct bf16 program (the single-device one) loses against exact
arithmetic on that tensor, step, seed and depth: it grows with depth as the Megatron-LM/TTrace rule
``k * C^depth * eps`` does, but is measured rather than assumed, so no constant ``C`` needs fitting per
architecture. One step's spread is one sample, and a sample can be lucky: where a tensor's rounding
error is coherent (one early rounding carried through the whole tensor, as in a gradient summed over
every token) its size swings from step to step (``transformer_encoder``'s ``linear1.weight`` gradient:
5.0%, 2.1%, 1.6%, then 1.0% relative in the first resumed step), and a parallel program that rounds
elsewhere (tp's partial sums) lands at the tensor's usual error, 4.4%, four times a lucky 1.0%. A
step can also be lucky on every tensor at once (the error of the logits is in every gradient):
``resnet_gn`` under ``tp`` (seed 0, step 1) measured the single-device run at 1/3 to 1/7 of its usual
error on all 21 gradients, the parallel program at the usual one. And a tensor whose gradient nearly
cancels (a per-channel weight summed over every position) has relative errors spread over a decade
from one step or point to the next (``conv1d_net``'s depthwise weight: 0.3% to 15.5%). So each
training and resumed step of a whole-model case takes two more samples of the spread from other
correct programs, the recipe at a point moved by a random half ulp of bf16 in every parameter against
float64 at that very point (:mod:`verify.cases.spread`: every rounding redrawn; where a discrete
selection, ``topk`` or ``argmax``, has scores tied within a rounding, a third with those choices
flipped), and the spread used is
the largest relative spread any sample showed on this tensor in the case so far (this step's three
included, the resumed phase continuing the training phase's record), times its norm now
(:class:`SpreadHistory`): the tensor's own range, not one draw of it. Measured with the samples dumped
per check (2026-11-26, 73 correct cases: the 10 cheapest built-in models under dp and tp at W=2,
seeds 0-2, the four former false alarms, pp, and nanogpt/llama/resnet_gn/conv1d_net under hybrid and
tp at W=4): the one-sample rule with the median false-alarmed on 7 cases (err/tol up to 1.82), this
one on none (worst 0.57, 0.97 with one moved point); the 7 wrong-annotation fixtures fail it by 29x to
301x (``bench/results/lowprec_calibration.md``). A wrong program's
errors are of the order of the tensor at its first step, where the record holds only that step. Two correct programs rounding independently differ by about sqrt(2) times one's error;
``LOWPREC_FACTOR = 4`` leaves margin for a parallel program's extra roundings (bf16 partial sums
reduced in bf16, as Megatron-LM does). ``LOWPREC_FLOOR = 0.5``: half an ulp of bf16 relative to the
tensor's norm (one rounding of a result), for a tensor the single-device run happens to get almost
exact: a scalar loss lands near its float64 value by chance (measured without the floor: 8 of 18
correct nanogpt/llama cases false-alarmed on a loss, err/tol up to 4.1, while every gradient stayed
below 0.46). The old rule's ``FLOOR_EPS * eps * max|ref|`` let a bf16 loss of 4.17 be off by 0.68; this one
allows about 0.02 (its spread, ~1e-3 relative, times 4, plus 0.016). Wrong partitions give errors of
the order of the tensor itself (relative ~0.1-1), one to two orders above. Measured (bench/results/
lowprec_calibration.md): nanogpt and llama under dp, tp, hybrid and pp at W=2, 5 seeds, 3 steps with
checkpoint resume (40 cases), worst err/tol 0.41; the wrong annotations of
tests/fixtures/wrong_ops_models.py and wrong_model.py all MISMATCH (``tests/harness/test_precision_harness.py``).
Optimizer updates are judged as in float32 (``check_update``, in the parameters' own dtype:
bf16-mixed keeps fp32 master weights and AdamW state, so the update is the same fp32 arithmetic).

**float64 fallback.** Where an operator has no float64 kernel (``torch._grouped_mm``), the float64
reference runs that operator alone in the dtype under test (:class:`Float64Fallback`) and upcasts its
result; the reference is then only as exact as the test dtype around that operator, so checks of such
a case use ``FALLBACK_WIDEN`` times the factor and the floor (its reference error is of the size of the
single-device error, which the widened bound absorbs), and the row names the operators.

**float32 islands.** Many real models compute softmax, norms and rotary embeddings in float32
whatever their input dtype (``.float()``, ``dtype=torch.float32``), and make constants with the default
dtype (``torch.full((), finfo.min)``). A float64 run of such a model is not a float64 program: its
single-device error against a reference with the same islands would be zero while the parallel
program rounds its float32 islands in another order (errors ~1e-8 against bounds ~5e-16). So the
float64 *reference* promotes them (:class:`Float64Fallback`): every operator asked for a narrower
floating dtype (``dtype=`` float32, float16 or bfloat16, as ``.float()``/``.to()`` and ``softmax(dtype=)``
reach ATen) computes in float64 instead, and factories without a dtype make float64 (the default dtype
is float64 inside the reference). The single-device and parallel runs keep their islands, so the bound
``FACTOR * err(dev)`` is the islands' own rounding, and in a float64 run the floor counts float32 ulps
(the narrowest precision the program ran in: :meth:`Float64Fallback.bounds`); the row names the
promoted operators. A logic error still gives errors of the order of the values.

**Random draws.** The float64 reference draws exactly the numbers the run in the dtype under test drew
(every call that draws runs in the run's dtype from the same generator state, its results converted:
:mod:`verify.judge.draw_record`), so ``err(dev)`` is rounding alone and no bound widens because of a
draw (before: a model adding ``0.1 * randn_like(h)`` drew other numbers in float64, up to 4.9 apart, and
its bounds grew ~300x, to ~1e-1, absorbing a wrong partition). A draw that cannot be made equal makes
the row ``unverifiable`` (:func:`verify.cases.draws.check_draws`).

**Kinks.** A value within rounding of a kink (``relu``, ``clamp``, ``abs``, ``maximum``/``minimum``, a
comparison) may land on either side, moving every gradient downstream by a whole term. The float64
reference takes the run's side there (:class:`verify.cases.kinks.KinkFollow`, as draws are replayed), so
one device's own flip never widens a bound (before: the kink fixture models' gradient bounds grew
5e3-3e5x on 15 seeds of 30 at tp W=2, to ~4e-2). A parallel program that lands elsewhere fails its step
unless some of the step's near-kink values, each put alone on the other side of one device's run,
explain its gradients exactly (:mod:`verify.judge.kinks`): their contributions are taken off and every
gradient must then meet its unchanged bound; the row says how many (before: a correct tp program at W=4
was a MISMATCH localised to ``relu`` on 3 seeds of 20).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verify.judge.draw_record import DrawRecord, may_draw
from verify.judge.dtypes import convert
from verify.judge.verdict import WIDENED

FACTOR = 4.0
FLOOR_EPS = 16.0
PARTIAL_EPS = 2.0
UPDATE_EPS = 4.0  # an optimizer step: a few ulps of the parameter and of the update
WIDE_NOTE = 64.0  # a bound this many times its dtype's own rounding floor is named in the row, with why
FALLBACK_WIDEN = 2.0  # both bounds, where the float64 reference fell back for some operator
LOWPREC_FACTOR = 4.0  # bf16 recipes: times the single-device run's own Frobenius error
LOWPREC_FLOOR = 0.5  # bf16 recipes: ulps of bf16 relative to the tensor's Frobenius norm


class SpreadHistory:
    """Per tensor of a case (its check name less the step and the phase's ``where: `` prefix), every
    relative spread ``||dev - ref|| / ||ref||`` of a correct program measured so far: the single-device
    run's at each step judged, and the moved points' (:mod:`verify.cases.spread`)."""

    def __init__(self):
        self.rel: dict[str, list[float]] = {}
        self.selects: bool | None = None  # whether the model makes a discrete selection (top-k, argmax; found by the first tie-flip sample)

    @staticmethod
    def key(name: str) -> str:
        return re.sub(r" (after )?step \d+$", "", name.rpartition(": ")[2])

    def add(self, key: str, rel: float) -> None:
        """Another correct program's relative spread on tensor ``key`` at the step about to be judged
        (:func:`verify.cases.spread.moved_samples`)."""
        if math.isfinite(rel):
            self.rel.setdefault(key, []).append(rel)

    def spread(self, name: str, spread: float, norm: float) -> float:
        """Record this step's ``spread`` of tensor ``name`` (of Frobenius norm ``norm``); the spread the
        bound uses: the largest relative spread recorded for the tensor (this one included) times ``norm``."""
        if not norm > 0 or not math.isfinite(spread):
            return spread
        seen = self.rel.setdefault(self.key(name), [])
        seen.append(spread / norm)
        return max(spread, max(seen) * norm)


@dataclass(frozen=True)
class Check:
    """The verdict on one tensor: its error against float64, the bound it had to meet."""

    name: str
    err: float
    tol: float
    ok: bool
    reason: str = ""
    widened: float = 0.0  # the bound over its dtype's own rounding (FLOOR_EPS ulps of the scale); 0: not measured

    @property
    def ratio(self) -> float:
        if not self.ok and self.err == 0:
            return float("inf")
        return self.err / self.tol if self.tol > 0 else (0.0 if self.err == 0 else float("inf"))


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def _none_check(name: str, par, dev, ref) -> Check:
    if par is None and dev is None and ref is None:
        return Check(name, 0.0, 0.0, True)
    if par is None and dev is None:
        return Check(name, float("inf"), 0.0, False, "missing on both sides, but the float64 reference has it")
    which = "parallel" if par is None else "single-device"
    return Check(name, float("inf"), 0.0, False, f"missing in the {which} run (None against a tensor)")


def _shape_dtype(name: str, par: torch.Tensor, dev: torch.Tensor) -> Check | None:
    if tuple(par.shape) != tuple(dev.shape):
        return Check(name, float("inf"), 0.0, False, f"shape {tuple(par.shape)} != {tuple(dev.shape)}")
    if par.dtype != dev.dtype:
        return Check(name, float("inf"), 0.0, False, f"dtype {par.dtype} != {dev.dtype}")
    return None


def check_tensor(name: str, par, dev, ref, factor: float = FACTOR, floor_eps: float = FLOOR_EPS,
                 scale: float | None = None, lowprec: bool = False, history: SpreadHistory | None = None,
                 partials: float = 0.0) -> Check:
    """Judge ``par`` against the float64 ``ref``, calibrated by the single-device ``dev``; ``scale``
    replaces ``max|ref|`` in the floor (whole models pass the largest gradient of the step, since a
    gradient that is zero in exact arithmetic is pure rounding noise of larger terms); ``history``: the
    case's record of single-device spreads, for the low-precision rule; ``partials``: the magnitude of
    the partial values a value-split sum added up into ``par`` (sum over ranks of ``max|partial|``)."""
    if par is None or dev is None or ref is None:
        return _none_check(name, par, dev, ref)
    if not isinstance(par, torch.Tensor):
        ok = par == dev
        return Check(name, 0.0 if ok else float("inf"), 0.0, ok, "" if ok else f"{par!r} != {dev!r}")
    bad = _shape_dtype(name, par, dev)
    if bad:
        return bad
    if not (par.is_floating_point() or par.is_complex()):
        bad = int((par != dev).sum())
        return Check(name, float(bad), 0.0, bad == 0, f"{bad} of {par.numel()} elements differ" if bad else "")
    wide = torch.complex128 if par.is_complex() else torch.float64  # complex: compared whole, not its real part
    if lowprec:  # a bf16 recipe: the low-precision rule (module docstring)
        return check_lowprec(name, par, dev, ref, widen=factor / FACTOR, history=history)
    par64, dev64, ref = par.to(wide), dev.to(wide), ref.to(wide)
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(par64), finite) or not torch.equal(par64[~finite].nan_to_num(), ref[~finite].nan_to_num()):
        bad = int((torch.isfinite(par64) != finite).sum())
        return Check(name, float("inf"), 0.0, False, f"NaN/inf in {bad} places where the reference differs")
    err = _max_abs((par64 - ref)[finite])
    err_dev = _max_abs((dev64 - ref)[finite])
    eps = torch.finfo(par.dtype).eps
    size = _max_abs(ref[finite]) if scale is None else scale
    tol = factor * err_dev + floor_eps * eps * size + PARTIAL_EPS * eps * partials
    rounding = FLOOR_EPS * eps * size
    return Check(name, err, tol, err <= tol, "" if err <= tol else f"error {err:.3g} > tolerance {tol:.3g}",
                 tol / rounding if rounding > 0 else 0.0)


def check_lowprec(name: str, par: torch.Tensor, dev: torch.Tensor, ref: torch.Tensor, widen: float = 1.0,
                  history: SpreadHistory | None = None) -> Check:
    """The low-precision rule (module docstring): ``par`` against the single-device run ``dev`` of the
    same recipe, bounded by ``dev``'s own distance from the float64 ``ref`` (at least its median over
    the case's steps in ``history``), in the Frobenius norm."""
    par64, dev64, ref64 = par.double(), dev.double(), ref.double()
    finite = torch.isfinite(ref64)
    if not torch.equal(torch.isfinite(par64), finite):
        bad = int((torch.isfinite(par64) != finite).sum())
        return Check(name, float("inf"), 0.0, False, f"NaN/inf in {bad} places where the reference differs")
    err = float((par64 - dev64)[finite].norm())
    spread, norm = float((dev64 - ref64)[finite].norm()), float(ref64[finite].norm())
    if history is not None:
        spread = history.spread(name, spread, norm)
    tol = widen * (LOWPREC_FACTOR * spread + LOWPREC_FLOOR * torch.finfo(torch.bfloat16).eps * norm)
    ok = err <= tol
    return Check(name, err, tol, ok, "" if ok else f"error {err:.3g} > tolerance {tol:.3g} (bf16 rule: "
                 f"{LOWPREC_FACTOR:g} x the single-device spread {spread:.3g} + floor)")


def check_update(name: str, par, want, lr: float, widen: float = 1.0) -> Check:
    """An optimizer step: ``par`` (the parallel run's parameter after its step) against ``want`` (AdamW
    on one device from the same parameter, history and gradient); per element
    ``|par - want| <= UPDATE_EPS * eps * (|want| + lr)``. ``err``/``tol`` report the worst element."""
    if par is None or want is None:
        return _none_check(name, par, want, want)
    bad = _shape_dtype(name, par, want)
    if bad:
        return bad
    par64, want64 = convert(par, torch.float64), convert(want, torch.float64)  # complex stays complex
    if not torch.isfinite(par64).all():
        return Check(name, float("inf"), 0.0, False, "NaN/inf after the step")
    diff = (par64 - want64).abs()
    bound = widen * UPDATE_EPS * torch.finfo(par.dtype).eps * (want64.abs() + lr)
    if not diff.numel():
        return Check(name, 0.0, 0.0, True)
    worst = int(torch.argmax(diff - bound))
    err, tol = float(diff.flatten()[worst]), float(bound.flatten()[worst])
    ok = bool((diff <= bound).all())
    return Check(name, err, tol, ok, "" if ok else f"error {err:.3g} > tolerance {tol:.3g} (element {worst})")


LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
NARROW = (*LOW_PRECISION, torch.complex64, torch.complex32)  # an input the float64 reference should not hold


class Float64Fallback(TorchDispatchMode):
    """The float64 reference's mode (see the module docstring). Every operator asked for a narrower
    floating dtype computes in float64 (its name is collected in ``promoted``) and the default dtype is
    float64 inside; one that fails on float64 inputs (no float64 kernel) runs again with its float64
    tensors cast to ``low`` and its floating results cast back to float64 (collected in ``used``). A call
    that draws random numbers draws them as the run in the dtype under test did (``draws``, recorded
    around that run: :mod:`verify.judge.draw_record`)."""

    def __init__(self, low: torch.dtype = torch.float32, lowprec: bool = False, spreads: SpreadHistory | None = None):
        super().__init__()
        self.dtype = low  # the dtype under test
        self.lowprec = lowprec  # a bf16 recipe: checks follow the low-precision rule
        self.spreads = spreads if spreads is not None else SpreadHistory()  # its record of single-device spreads
        self.low = low if low != torch.float64 else torch.float32
        self.used: set[str] = set()
        self.promoted: set[str] = set()
        self.narrow: dict[str, str] = {}  # operator -> the narrower-than-float64 dtype it was handed in the reference
        self.draws = DrawRecord()  # the run's draws: record them around it with ``draws.recording()``
        self.kinks_followed = 0  # the most near-kink values of a step the reference put on the run's side (verify/cases/kinks.py)
        self._default: list[torch.dtype] = []

    def __enter__(self):
        self._default.append(torch.get_default_dtype())
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.set_default_dtype(self._default.pop())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if may_draw(func):  # drawn as the run drew (verify/judge/draw_record.py)
            return self.draws.redraw(func, args, kwargs, lambda: self._call(func, args, kwargs))
        return self._call(func, args, kwargs)

    def _call(self, func, args, kwargs):
        if len(self.narrow) < 8:
            for x in torch.utils._pytree.tree_leaves(args):
                if isinstance(x, torch.Tensor) and x.dtype in NARROW:
                    self.narrow.setdefault(str(func), str(x.dtype).removeprefix("torch."))
                    break
        if kwargs.get("dtype") in LOW_PRECISION:
            kwargs = {**kwargs, "dtype": torch.float64}
            self.promoted.add(str(func))
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as exc:
            f64 = [x for x in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(x, torch.Tensor) and x.dtype == torch.float64]
            if not f64:
                raise
            down = lambda x: x.to(self.low) if isinstance(x, torch.Tensor) and x.dtype == torch.float64 else x  # noqa: E731
            try:
                out = func(*torch.utils._pytree.tree_map(down, args), **torch.utils._pytree.tree_map(down, kwargs))
            except Exception:
                raise exc from None
            self.used.add(str(func))
            up = lambda x: x.double() if isinstance(x, torch.Tensor) and x.dtype == self.low else x  # noqa: E731
            return torch.utils._pytree.tree_map(up, out)

    @property
    def widen(self) -> float:
        """How much wider the bounds are where the reference fell back for some operator."""
        return FALLBACK_WIDEN if self.used else 1.0

    def bounds(self, tensor_dtype: torch.dtype | None = None) -> dict:
        """``factor`` and ``floor_eps`` of :func:`check_tensor` for what this reference did: widened where
        it fell back; in a float64 run whose model computes float32 islands, the floor counts float32
        ulps (the narrowest precision the program ran in), not float64's. ``tensor_dtype``: the dtype of
        the tensor judged, where it is not the run's (a tensor of an island is float32 itself, and its
        floor counts its own ulps already)."""
        floor = FLOOR_EPS * self.widen
        if self.promoted and self.dtype == torch.float64 and tensor_dtype in (None, torch.float64):
            floor *= torch.finfo(torch.float32).eps / torch.finfo(torch.float64).eps
        return {"factor": FACTOR * self.widen, "floor_eps": floor, "lowprec": self.lowprec,
                "history": self.spreads if self.lowprec else None}

    def notes(self, dtype: str, checks: list[Check] = ()) -> list["Check"]:
        """Passing checks that say, in the row's checks, what the float64 reference did differently; and
        for ``checks`` whose bound is over :data:`WIDE_NOTE` times their dtype's rounding, why
        (:meth:`widened_note`)."""
        out = self.widened_note(checks)
        if self.used:
            out.append(Check(f"note: float64 reference ran {', '.join(sorted(self.used))} in {dtype}", 0.0, 0.0, True))
        if self.promoted:
            out.append(Check(f"note: float64 reference promoted float32 islands to float64 "
                             f"({', '.join(sorted(self.promoted))})", 0.0, 0.0, True))
        if self.narrow:
            out.append(Check("note: float64 reference held narrower tensors at " + ", ".join(
                f"{op} ({dt})" for op, dt in sorted(self.narrow.items())), 0.0, 0.0, True))
        if self.kinks_followed:
            out.append(Check("note: kinks followed", 0.0, 0.0, True,
                             f"the float64 reference took the run's side of a kink at values within rounding of it "
                             f"({self.kinks_followed} at most in a step)"))
        if self.draws.redrawn:
            out.append(Check(f"note: float64 reference drew random numbers in the run's dtype "
                             f"({', '.join(sorted(self.draws.redrawn))})", 0.0, 0.0, True))
        return out

    def widened_note(self, checks: list[Check]) -> list[Check]:
        """One passing ``note: widened bound`` check naming the checks whose bound exceeds their dtype's
        own rounding :data:`WIDE_NOTE`-fold (the widest first) and what made the single-device run so far
        from float64: operators the reference ran narrower than float64 or fell back on, islands it
        promoted, or, where none, the model's own conditioning at that tensor. [] where none is wide."""
        wide = sorted((c for c in checks if c.widened > WIDE_NOTE), key=lambda c: -c.widened)
        if not wide:
            return []
        named = ", ".join(f"{c.name} {c.widened:.0f}x" for c in wide[:3]) + (f" and {len(wide) - 3} more" if len(wide) > 3 else "")
        why = [f"the reference held narrower tensors at {', '.join(sorted(self.narrow))}"] if self.narrow else []
        why += [f"it ran {', '.join(sorted(self.used))} in {self.low}"] if self.used else []
        why += [f"float32 islands ({', '.join(sorted(self.promoted))})"] if self.promoted else []
        why += [] if why else ["no operator of the float64 reference ran narrower: the model's own rounding at that tensor"]
        return [Check(f"{WIDENED} (over {WIDE_NOTE:g}x the dtype's rounding): {named}; why: {'; '.join(why)}",
                      0.0, 0.0, True)]
