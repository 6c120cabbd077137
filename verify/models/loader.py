"""A model to verify, named either as a registered model (``nanogpt``) or as a user's builder in a
file (``path/to/file.py:builder``, or ``path/to/file.py:builder@WIDTH`` for ``builder(seed, WIDTH)``).
A builder is ``builder(seed)`` returning a :class:`~verify.models.registry.ModelCase`, or a pair
``(model, batch_fn)`` with ``batch_fn(step)`` giving the sample arguments of a training step. The
file's folder goes first on ``sys.path``, as under ``python file.py``."""
from __future__ import annotations

import inspect
import re
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch

from verify.models.registry import MODELS, WIDENABLE, ModelCase
from verify.user_files import import_once
from verify.models.saved_plan import build_case, is_plan_reference
from verify.models.zoo import is_zoo, zoo_builder


class ModelNotFound(ValueError):
    """The model reference names no registered model and no builder in a file (exit 2 on the CLI)."""


HOW_TO_ADD = ("pass FILE.py:BUILDER[@WIDTH], where BUILDER(seed[, WIDTH]) returns a ModelCase or (model, batch_fn), "
              "or decorate a builder with verify.models.register_model('NAME') in a file given with --module")


def import_file(path: Path):
    name = f"verify_user_{abs(hash(str(path)))}"  # as verify.runner.worker.load_modules names it: imported once
    if str(path.parent) not in sys.path:  # its sibling modules import, as under ``python FILE.py`` (first)
        sys.path.insert(0, str(path.parent))
    try:  # once, whatever else imports the file (a --module, its own `import`): verify/user_files.py
        return import_once(path, name)
    except ImportError as exc:
        if str(exc).endswith("not a Python file"):
            raise ModelNotFound(f"{path}: not a Python file") from None
        raise ModelNotFound(f"importing {path} failed: {type(exc).__name__}: {exc}{_where(path, exc)}") from None
    except Exception as exc:
        raise ModelNotFound(f"importing {path} failed: {type(exc).__name__}: {exc}{_where(path, exc)}") from None


def file_tag(ref: str) -> str:
    """A file-name-safe tag for a model or policy reference (``/work/m.py:build`` -> ``m.py-build``), so
    generated programs stay inside the directory meant for them."""
    return re.sub(r"[^A-Za-z0-9_.@-]+", "-", Path(ref).name).strip("-") or "model"


def is_file_reference(ref: str) -> bool:
    """``file.py:builder`` rather than a registered name."""
    path, sep, attr = ref.rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(attr)


def find_builder(ref: str) -> Callable[[int], ModelCase]:
    """The builder ``ref`` names; :class:`ModelNotFound` with how to fix it otherwise."""
    if is_plan_reference(ref):  # a saved cluster plan: the model it describes (verify.models.saved_plan)
        if not Path(ref).is_file():
            raise ModelNotFound(f"model {ref!r}: no such plan file")
        return _checked(lambda seed: build_case(ref, seed), ref)
    if is_zoo(ref):  # zoo:<model_type>: transformers' architecture, shrunk (verify.models.zoo)
        try:
            return _checked(zoo_builder(ref), ref)
        except KeyError as exc:
            raise ModelNotFound(exc.args[0]) from None
    if not is_file_reference(ref):
        if ref in MODELS:
            return _checked(MODELS[ref], ref)
        raise ModelNotFound(f"unknown model {ref!r}; known: {', '.join(sorted(MODELS))}; to add one, {HOW_TO_ADD}")
    path_text, _, attr = ref.rpartition(":")
    attr, at, width = attr.partition("@")
    if at and not (width.isdigit() and int(width) > 0):
        raise ModelNotFound(f"model {ref!r}: the width after '@' must be a positive integer, got {width!r}")
    path = Path(path_text)
    if not path.is_file():
        raise ModelNotFound(f"model {ref!r}: no such file {path_text}")
    module = import_file(path.resolve())
    builder = getattr(module, attr, None)
    if builder is None or not callable(builder):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        raise ModelNotFound(f"model {ref!r}: {path_text} has no function {attr!r} (functions there: "
                            f"{', '.join(names) or 'none'})")
    if at:  # FILE.py:builder@WIDTH, as NAME@WIDTH of a built-in: builder(seed, WIDTH)
        try:
            inspect.signature(builder).bind(0, int(width))
        except TypeError:
            raise ModelNotFound(f"model {ref!r}: {attr} takes no width; define {attr}(seed, width) to build it "
                                f"at @{width}") from None
        except ValueError:
            pass  # no signature to read: the call says
        n = int(width)

        def at_width(seed: int):
            return builder(seed, n)
        at_width.__name__ = f"{attr}@{n}"
        return _checked(at_width, ref)
    return _checked(builder, ref)


def _checked(builder: Callable, ref: str) -> Callable[[int], ModelCase]:
    def build(seed: int) -> ModelCase:
        case = builder(seed)
        if isinstance(case, tuple) and len(case) == 2:
            case = ModelCase(*case)
        if not isinstance(case, ModelCase) or not isinstance(case.model, torch.nn.Module) or not callable(case.batch):
            raise ModelNotFound(f"model {ref!r}: the builder returned {type(case).__name__}; it must return a "
                                f"ModelCase(model, batch_fn) or a pair (torch.nn.Module, batch_fn)")
        return case
    build.__name__ = getattr(builder, "__name__", "builder")
    return build


def _where(path: Path, exc: BaseException) -> str:
    """`` (at FILE:LINE: code)``: the innermost line of ``path`` in the exception's traceback, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f" (at {path.name}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""


def _raised(ref: str, what: str, exc: BaseException) -> ModelNotFound:
    """One line naming ``what`` raised, the exception and the innermost line of the user's file."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return ModelNotFound(f"model {ref!r}: {what} raised {type(exc).__name__}: {text}"
                         f"{_where(Path(ref.rpartition(':')[0]), exc)}")


def check_builder(ref: str, seed: int = 0) -> ModelCase:
    """Build once in this process and run one forward on the step-0 batch: a builder that does not
    exist, raises, returns the wrong type, or whose batch does not fit the model fails here, in one
    line, before any rank starts. Returns the case (the parent's one inspection build)."""
    try:
        builder = find_builder(ref)
    except ModelNotFound:
        raise
    except Exception as exc:  # the file itself raised on import (ModelNotFound is the usual answer)
        raise _raised(ref, f"importing {ref.rpartition(':')[0]}", exc) from None
    try:
        case = builder(seed)
    except ModelNotFound:
        raise
    except Exception as exc:
        raise _raised(ref, f"the builder {ref.rpartition(':')[2]}({seed})", exc) from None
    try:
        args = case.batch(0)
    except Exception as exc:
        raise _raised(ref, "batch_fn(0)", exc) from None
    if not isinstance(args, tuple):
        raise ModelNotFound(f"model {ref!r}: batch_fn(step) must return a tuple of arguments, got {type(args).__name__}")
    try:
        with torch.no_grad():
            loss = case.model(*args)
    except Exception as exc:
        raise ModelNotFound(f"model {ref!r}: the model does not accept its batch: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        raise ModelNotFound(f"model {ref!r}: the model must return its scalar loss, got "
                            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    return case


def known_model(name: str) -> bool:
    """Whether :func:`build_model` knows ``name`` (a registered model or ``NAME@WIDTH``)."""
    if is_plan_reference(name):
        return Path(name).is_file()
    if is_zoo(name):
        try:
            return zoo_builder(name) is not None
        except (KeyError, ImportError):
            return False
    base, _, width = name.partition("@")
    return name in MODELS or (base in WIDENABLE and width.isdigit() and int(width) > 0)


def build_model(name: str, seed: int) -> ModelCase:
    """The case of model ``name`` (see :data:`MODELS` and :data:`WIDENABLE`, or ``FILE.py:builder``)
    for ``seed``."""
    if is_file_reference(name) or is_plan_reference(name) or is_zoo(name):
        return find_builder(name)(seed)
    if name in MODELS:
        return MODELS[name](seed)
    base, _, width = name.partition("@")
    if not known_model(name):
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}, or NAME@WIDTH for "
                       f"{', '.join(sorted(WIDENABLE))}")
    return WIDENABLE[base](seed, int(width))
