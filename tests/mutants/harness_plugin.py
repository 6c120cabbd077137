"""A pytest plugin applying one harness mutant (``tests/mutants/harness``) to a test run:
``python -m pytest -p tests.mutants.harness_plugin --harness-mutant NAME NODEID...``. The mutant is applied
in the pytest process at configure time and, through a generated ``--module`` file every rank gang started
in the run imports (appended to :attr:`verify.runner.gang.Gang.modules` before it starts), in every rank."""
from __future__ import annotations

import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def shim(directory: Path, name: str) -> Path:
    """A module file that applies harness mutant ``name`` on import (a rank imports it by path)."""
    path = directory / f"harness_mutant_{name}.py"
    path.write_text(f'"""Applies harness mutant {name} on import (generated)."""\n'
                    "import sys\n"
                    f"if {str(ROOT)!r} not in sys.path:\n"
                    f"    sys.path.insert(0, {str(ROOT)!r})\n"
                    "from tests.mutants.harness import apply\n"
                    f"apply({name!r})\n")
    return path


def pytest_addoption(parser):
    parser.addoption("--harness-mutant", default=None, metavar="NAME",
                     help="apply this harness mutant (tests/mutants/harness) here and in every rank gang")


class Applied:
    """Applies harness mutant ``name`` when pytest configures and puts everything back when it ends (so
    one process can run several mutants in turn: ``tests/mutants/harness_run.py --fast``)."""

    def __init__(self, name: str):
        self.name = name

    def pytest_configure(self, config):
        from tests.mutants.harness import apply, undo
        from verify.runner.gang import Gang
        undo()
        path = str(shim(Path(tempfile.mkdtemp(prefix="harness_mutant_")), self.name))
        self.start = start = Gang.start

        def start_with_mutant(gang):
            if path not in gang.modules:
                gang.modules.append(path)
            return start(gang)
        Gang.start = start_with_mutant
        apply(self.name)

    def pytest_unconfigure(self, config):
        from tests.mutants.harness import undo
        from verify.runner.gang import Gang
        undo()
        Gang.start = self.start


def pytest_configure(config):
    name = config.getoption("--harness-mutant", None)
    if name:
        plugin = Applied(name)
        config.pluginmanager.register(plugin, "harness-mutant-applied")
        plugin.pytest_configure(config)
