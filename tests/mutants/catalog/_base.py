"""What every family of mutants shares: the registry (:data:`MUTANTS`, :func:`mutant`), :func:`apply`,
:func:`patch` and the lazy imports of the modules several families patch."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

MUTANTS: dict[str, Callable[[], None]] = {}


def mutant(fn: Callable[[], None]) -> Callable[[], None]:
    MUTANTS[fn.__name__] = fn
    return fn


def apply(name: str) -> None:
    """Apply mutant ``name`` (a KeyError names the known ones)."""
    if name not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}")
    MUTANTS[name]()
    from opzoo.rulekit import rederive_examples  # the operator cases' examples, derived at import, see a mutated rule
    rederive_examples()


def patch(owner, attr: str, value) -> None:
    """``setattr(owner, attr, value)``, refusing an attribute ``owner`` lacks: a mutant whose target
    was renamed fails to apply (the run is broken) instead of patching nothing and surviving."""
    if not hasattr(owner, attr):
        raise AttributeError(f"mutant target {getattr(owner, '__name__', owner)}.{attr} does not exist")
    setattr(owner, attr, value)


@contextmanager
def swapped(owner, attr: str, value) -> Iterator[None]:
    """``owner.attr`` is ``value`` inside the block only (for a mutant that bends one call)."""
    before = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, before)


def _C():
    from nnscaler.runtime import collectives as C
    return C


def _GS():
    from nnscaler.runtime import grad_sync
    return grad_sync
