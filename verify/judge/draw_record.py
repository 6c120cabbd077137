"""Random draws of the float64 reference made equal to the run's: recorded in the run, redrawn alike.

The bound of a check is set by the single-device run's distance from its float64 reference. A model
that draws random numbers (``randn_like``, ``rand``, ``bernoulli_``, ``exponential_``, ``multinomial``,
``randperm``, ``randint``, dropout, a custom operator that draws inside) draws other numbers in
float64 than in float32 from the same generator state (CPU ``randn`` fills float32 from 24-bit and
float64 from 53-bit uniforms: measured up to 4.9 apart), so that distance, and the bound with it,
grew to the size of the noise and absorbed wrong programs. Here every call that draws runs in the
float64 reference as it ran in the run it calibrates:

* :meth:`DrawRecord.recording` (a dispatch mode around the single-device run in the dtype under
  test) notes, for every call that draws (an ATen operator tagged ``nondeterministic_seeded``, or any
  other operator whose call moves the generator: a user's custom operator), the generator state
  before it, the dtypes of its floating tensor arguments and results, and the state after it;
* :meth:`DrawRecord.redraw` (called by :class:`verify.judge.compare.Float64Fallback` for every such
  call of the float64 reference) finds the record made from the same generator state, runs the call
  with its float64 tensors cast to the recorded dtypes (``dtype=`` too), and casts the results back up:
  the same numbers, converted. Its generator state after must be the recorded one.

A call that cannot be drawn alike (no run drew from that state, another consumption of the
generator, a ``torch.Generator`` of the model's own, whose state no run resets) is listed in
:attr:`DrawRecord.problems` with the operator and the user's source line; the case makes its row
``unverifiable`` (:func:`verify.cases.draws.check_draws`). A draw never widens a bound.
"""
from __future__ import annotations

import contextlib
import functools
import sysconfig
import traceback
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

_HARNESS = ("/torch/", "/nnscaler/", "<")
_STDLIB = sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=None)
def draws(func) -> bool:
    """Whether ``func`` is known to draw random numbers (an ATen overload tagged ``nondeterministic_seeded``)."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


@functools.lru_cache(maxsize=None)
def may_draw(func) -> bool:
    """Whether a call of ``func`` must be watched: a tagged ATen operator, or any operator outside
    ATen and prims (a custom operator may draw inside)."""
    return draws(func) or getattr(func, "namespace", "aten") not in ("aten", "prims")


def user_line() -> str:
    """``file:line: code`` of the innermost frame of the user's code on the stack (not torch's, nnscaler's
    or the harness's), or ``?``."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        harness = "/verify/" in frame.filename and "/verify/models/" not in frame.filename
        if not (harness or frame.filename.startswith(_STDLIB) or any(p in frame.filename for p in _HARNESS)):
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "?"


def _device(args, kwargs) -> torch.device:
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def generator_state(device: torch.device) -> bytes:
    """The state of the default generator that a call on ``device`` draws from."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device).numpy().tobytes()
    return torch.default_generator.get_state().numpy().tobytes()


def _own_generator(args, kwargs) -> bool:
    return any(isinstance(x, torch.Generator) for x in tree_flatten((args, kwargs))[0])


@dataclass(frozen=True)
class Draw:
    """One recorded call that drew: the dtypes of its floating tensor arguments (flattened, ``None``
    for others), its ``dtype=`` keyword, its results' dtypes, and the generator state after it."""

    arg_dtypes: tuple
    dtype_kwarg: torch.dtype | None
    out_dtypes: tuple
    after: bytes


def _floating_dtypes(tree) -> tuple:
    return tuple(x.dtype if isinstance(x, torch.Tensor) and x.is_floating_point() else None
                 for x in tree_flatten(tree)[0])


class _OfRecord(TorchDispatchMode):
    def __init__(self, record: "DrawRecord"):
        super().__init__()
        self.record = record


class _Recording(_OfRecord):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not may_draw(func):
            return func(*args, **kwargs)
        device = _device(args, kwargs)
        before = generator_state(device)
        out = func(*args, **kwargs)
        after = generator_state(device)
        if after == before and not (draws(func) and _own_generator(args, kwargs)):
            return out  # drew nothing (a custom operator that does not draw)
        if _own_generator(args, kwargs):
            self.record.problem(f"{func} at {user_line()} draws from a torch.Generator of the model's own "
                                f"(no run resets its state, so no two runs draw the same numbers)")
        self.record.draws[(before, str(func))] = Draw(_floating_dtypes((args, kwargs)), kwargs.get("dtype"),
                                                      _floating_dtypes(out), after)
        return out


class _Replaying(_OfRecord):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if may_draw(func):
            return self.record.redraw(func, args, kwargs, lambda: func(*args, **kwargs))
        return func(*args, **kwargs)


class DrawRecord:
    """The draws of a case's runs in the dtype under test, by generator state and operator, and the
    calls of its float64 reference that could not draw alike (module docstring)."""

    def __init__(self):
        self.draws: dict[tuple[bytes, str], Draw] = {}
        self.problems: list[str] = []
        self.redrawn: set[str] = set()  # operators the float64 reference drew in a narrower dtype

    def recording(self) -> contextlib.AbstractContextManager:
        """A dispatch mode that records every draw of the block (the single-device run in the dtype under test)."""
        return _Recording(self)

    def replaying(self) -> contextlib.AbstractContextManager:
        """A dispatch mode that draws every call of the block as the recorded run did (:meth:`redraw`), and
        runs every other call as it is: a float64 reference that needs nothing else of
        :class:`verify.judge.compare.Float64Fallback` (an operator case's)."""
        return _Replaying(self)

    def problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)

    def redraw(self, func, args, kwargs, plain):
        """Run ``func`` (a call of the float64 reference that may draw) as the recorded run did from
        the same generator state; ``plain()`` runs it as the reference runs any other call (an
        operator outside ATen that drew nothing in the run: it must draw nothing here either)."""
        device = _device(args, kwargs)
        before = generator_state(device)
        rec = self.draws.get((before, str(func)))
        if rec is None:  # no run drew here: it must draw nothing here either (a dropout with p=0)
            out = plain()
            if generator_state(device) != before:
                self.problem(f"{func} at {user_line()} draws random numbers where no run in the dtype under "
                             f"test drew from that generator state")
            return out
        if _own_generator(args, kwargs):
            self.problem(f"{func} at {user_line()} draws from a torch.Generator of the model's own")
        out = self._run(func, args, kwargs, rec)
        if generator_state(device) != rec.after:
            self.problem(f"{func} at {user_line()} drew another amount of random numbers in the float64 "
                         f"reference than in the run")
        return out

    def _run(self, func, args, kwargs, rec: Draw):
        """``func`` with its float64 tensors (and ``dtype=``) narrowed to the recorded dtypes, written-to
        arguments copied back, floating results widened to float64."""
        leaves, spec = tree_flatten((args, kwargs))
        want = rec.arg_dtypes if len(rec.arg_dtypes) == len(leaves) else None
        narrowed, back = [], []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
                dt = want[i] if want is not None else None
                if dt is not None and dt != torch.float64:
                    y = x.detach().to(dt)
                    narrowed.append(y)
                    back.append((x, y))
                    continue
            narrowed.append(x)
        args2, kwargs2 = tree_unflatten(narrowed, spec)
        kwargs2 = dict(kwargs2)
        if "dtype" in kwargs2 or rec.dtype_kwarg is not None:
            kwargs2["dtype"] = rec.dtype_kwarg
        elif _is_factory(func) and rec.out_dtypes and rec.out_dtypes[0] is not None:
            kwargs2["dtype"] = rec.out_dtypes[0]  # a factory that took the default dtype (float64 in the reference)
        if back or kwargs2.get("dtype") != kwargs.get("dtype"):
            self.redrawn.add(str(func))
        out = func(*args2, **kwargs2)
        written = {}
        for x, y in back:
            if _writes(func, x, args, kwargs):
                with torch.no_grad():
                    x.copy_(y)
                written[id(y)] = x

        def widen(t):
            if isinstance(t, torch.Tensor):
                if id(t) in written:
                    return written[id(t)]
                if t.is_floating_point() and t.dtype != torch.float64:
                    return t.to(torch.float64)
            return t
        return tree_map(widen, out)


def _is_factory(func) -> bool:
    """Whether ``func`` takes no tensor (its dtype is ``dtype=`` or the default dtype)."""
    return not any(str(a.type).startswith("Tensor") for a in func._schema.arguments)  # (no public accessor)


def _writes(func, x, args, kwargs) -> bool:
    """Whether ``func`` writes into argument ``x`` (an in-place draw: ``normal_``, ``bernoulli_``, ``out=``)."""
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        value = kwargs.get(a.name, args[i] if i < len(args) and not a.kwarg_only else None)
        if value is x and a.alias_info is not None and a.alias_info.is_write:
            return True
    return False
