"""A user's Python file imported once, whatever names import it: ``--module ops.py`` (or pytest's
``verify_modules``), a ``FILE.py:builder`` model, a ``FILE.py:fn`` policy, and the same file's plain
``import ops`` (or ``from pkg import ops``) in the model or test file all get the one module object,
so its ``register_op`` calls run once (a second run of them is "already registered")."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


class _Existing(importlib.abc.Loader):
    """Loads a module that is already loaded: the very object, not executed again."""

    def __init__(self, module: ModuleType):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        pass


class UserFiles(importlib.abc.MetaPathFinder):
    """The files imported by :func:`import_once` (by resolved path): an ``import`` whose search finds
    one of them is answered with its module."""

    def __init__(self):
        self.files: dict[Path, ModuleType] = {}

    def find_spec(self, fullname, path=None, target=None):
        stem = fullname.rpartition(".")[2]
        if not any(p.stem == stem for p in self.files):  # most imports: one look at the names
            return None
        found = importlib.machinery.PathFinder.find_spec(fullname, path)
        module = self.files.get(Path(found.origin).resolve()) if found is not None and found.origin else None
        return None if module is None else importlib.util.spec_from_loader(fullname, _Existing(module),
                                                                           origin=found.origin)


def _finder() -> UserFiles:
    """The interpreter's :class:`UserFiles`, first on ``sys.meta_path`` (put there on first use)."""
    found = next((f for f in sys.meta_path if isinstance(f, UserFiles)), None)
    if found is None:
        found = UserFiles()
        sys.meta_path.insert(0, found)
    return found


def _loaded(path: Path) -> ModuleType | None:
    """A module already imported from ``path`` under any name (a plain ``import`` before us)."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and file.endswith(path.name):
            try:
                if Path(file).resolve() == path:
                    return module
            except OSError:
                continue
    return None


def import_once(path: str | Path, name: str) -> ModuleType:
    """The module of the Python file ``path``: imported as ``name`` unless that file is imported
    already (under this or any name); every later ``import`` that finds the file gets the same
    module. Raises ``ImportError`` for a path that is not a Python file, and what the file raises
    (its module then forgotten)."""
    p = Path(path).resolve()
    finder = _finder()
    module = finder.files.get(p) or sys.modules.get(name) or _loaded(p)
    if module is not None:
        finder.files[p] = module
        sys.modules.setdefault(name, module)
        return module
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    finder.files[p] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        del finder.files[p]
        raise
    return module


def forget(path: str | Path) -> None:
    """Take the file ``path`` out again, under every name it was imported as: its next :func:`import_once`
    imports it afresh (a test that loads a file's rules for one module, then removes them)."""
    module = _finder().files.pop(Path(path).resolve(), None)
    if module is not None:
        for name in [n for n, m in sys.modules.items() if m is module]:
            sys.modules.pop(name, None)
