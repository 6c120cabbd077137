"""What every family of harness mutants shares: the registry (:data:`HARNESS`, :func:`mutant`), :func:`patch`
(rebinding a name wherever a loaded module imported it), :func:`applied` (undo) and, in ONE place, the lazy
imports of every ``verify/`` module a mutant patches: when a file moves, only its helper's import changes."""
from __future__ import annotations

import sys
from pathlib import Path
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator


@dataclass(frozen=True)
class Mutant:
    """One fail-open change: ``apply`` patches it in; ``target`` names what it bends (``file:name``);
    ``kills``: pytest node ids of the tests that kill it; ``owner``: the branch whose own tests are
    expected to kill it too (another helper's work in progress), or ``""``."""

    name: str
    apply: Callable[[], None]
    target: str
    kills: tuple[str, ...]
    owner: str = ""
    why: str = ""
    extra: dict = field(default_factory=dict)


HARNESS: dict[str, Mutant] = {}
_ROOT = str(Path(__file__).resolve().parents[3])  # modules of this checkout (tests too) are rebound as well
_JOURNAL: list[tuple[object, str, object, object]] = []  # (owner, attribute, value before, value set) per patch


def mutant(target: str, kills: list[str] | str, owner: str = "", why: str = ""):
    """Register the decorated function (its name is the mutant's) as a harness mutant."""
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        HARNESS[fn.__name__] = Mutant(fn.__name__, fn, target, tuple([kills] if isinstance(kills, str) else kills),
                                      owner, why or (fn.__doc__ or "").strip())
        return fn
    return register


def apply(name: str) -> None:
    """Apply harness mutant ``name`` (a KeyError names the known ones)."""
    if name not in HARNESS:
        raise KeyError(f"unknown harness mutant {name!r}; known: {', '.join(HARNESS)}")
    HARNESS[name].apply()


def _set(owner, attr: str, value) -> None:
    _JOURNAL.append((owner, attr, vars(owner).get(attr, _MISSING), value))
    setattr(owner, attr, value)


_MISSING = object()


def _ours(name: str, mod) -> bool:
    """Whether ``mod`` is a module of this checkout (``verify``, ``nnscaler``, the tests)."""
    return mod is not None and (name.startswith(("verify", "nnscaler"))
                                or str(getattr(mod, "__file__", "") or "").startswith(_ROOT))


def patch(owner, attr: str, value) -> None:
    """``owner.attr = value``, refusing an attribute ``owner`` lacks (a renamed target fails to apply instead
    of surviving); where ``owner`` is a module and the value a function or class, every loaded module of this
    checkout (``verify``, ``nnscaler``, the tests) that imported the same object by name (``from verify.judge.compare import
    check_tensor``) is rebound too (a constant is read through its module at call time)."""
    if not hasattr(owner, attr):
        raise AttributeError(f"mutant target {getattr(owner, '__name__', owner)}.{attr} does not exist")
    before = getattr(owner, attr)
    _set(owner, attr, value)
    if isinstance(owner, type) or not callable(before):
        return
    for name, mod in list(sys.modules.items()):
        if mod is owner or not _ours(name, mod):
            continue
        if vars(mod).get(attr) is before:
            _set(mod, attr, value)


def wrap(owner, attr: str, make: Callable[[Callable], Callable]) -> None:
    """Patch ``owner.attr`` with ``make(original)``."""
    patch(owner, attr, make(getattr(owner, attr)))


def undo() -> None:
    """Put back every patch made so far, latest first; a module imported while a mutant was applied (a test
    file that imported the mutated function by name) gets the original back too."""
    put_back = {}
    while _JOURNAL:
        owner, attr, before, value = _JOURNAL.pop()
        if before is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, before)
            put_back[(attr, id(value))] = (value, before)
    for name, mod in list(sys.modules.items()):
        if not _ours(name, mod):
            continue
        for (attr, _), (value, before) in put_back.items():
            if vars(mod).get(attr) is value:
                setattr(mod, attr, before)


@contextmanager
def applied(name: str) -> Iterator[None]:
    """Harness mutant ``name`` applied inside the block only."""
    undo()
    apply(name)
    try:
        yield
    finally:
        undo()


# -- the verify/ (and runtime) modules the mutants patch: their imports, in one place -----------------------
def _compare():
    from verify.judge import compare
    return compare


def _verdict():
    from verify.judge import verdict
    return verdict


def _selection():
    from verify.sweep import selection
    return selection


def _cache():
    from verify.sweep import cache
    return cache


def _shard():
    from verify.sweep import shard
    return shard


def _merge():
    from verify.sweep import merge
    return merge


def _reduced():
    from verify.models import saved_plan as reduced
    return reduced


def _plan_cli():
    from verify.plan import cli
    return cli


def _spread():
    from verify.cases import spread
    return spread


def _buffers():
    from verify.cases import buffers
    return buffers


def _training():
    from verify.cases import training
    return training


def _replicas_case():
    from verify.cases import replicas
    return replicas


def _resume():
    from verify.cases import resume
    return resume


def _tensor_trace():
    from verify.localize import tensor_trace
    return tensor_trace


def _torchpar_mesh():
    from verify.cases.torchpar import mesh as torchpar_mesh
    return torchpar_mesh


def _torchpar():
    from verify.cases.torchpar import case as torchpar
    return torchpar


def _torchpar_pipeline():
    from verify.cases.torchpar import pipeline
    return pipeline


def _collectives():
    from nnscaler.runtime import collectives
    return collectives


def _draws():
    from verify.cases import draws
    return draws


def _precision_record():
    from verify.cases import precision_record
    return precision_record


def _dtypes():
    from verify.judge import dtypes
    return dtypes


def _finite():
    from verify.judge import finite
    return finite


def _eager():
    from verify.localize import eager
    return eager


def _user_files():
    from verify import user_files
    return user_files


def _writer():
    from verify.report import writer
    return writer
