"""A user's file is imported once, whatever names import it: given with ``--module`` (or pytest's
``verify_modules``) and imported by the model (``import once_ops``) or a test file (``from pkg import
once_ops``), its ``register_op`` calls run once (it failed with "operator ... is already registered")."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from verify.cli import main
from verify.user_files import import_once
from verify.runner.worker import load_modules

ONCE = Path(__file__).parents[1] / "fixtures" / "imported_once"


def test_a_module_file_the_model_also_imports_is_imported_once(tmp_path, capsys):
    code = main(["model", f"{ONCE / 'once_model.py'}:build", "--module", str(ONCE / "once_ops.py"),
                 "--policy", "dp", "--world-size", "2", "--steps", "1"])
    out = capsys.readouterr()
    assert code == 0, out.out[-2000:] + out.err[-2000:]
    assert "already registered" not in out.err


def test_every_name_that_finds_the_file_gets_the_one_module(monkeypatch):
    load_modules([str(ONCE / "once_ops.py")])
    first = import_once(ONCE / "once_ops.py", "any_other_name")
    monkeypatch.syspath_prepend(str(ONCE.parent.parent.parent))
    monkeypatch.syspath_prepend(str(ONCE))
    for name in ("once_ops", "tests.fixtures.imported_once.once_ops"):
        sys.modules.pop(name, None)
        assert importlib.import_module(name) is first, name
