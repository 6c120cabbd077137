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


def pytest_configure(config):
    name = config.getoption("--harness-mutant")
    if not name:
        return
    from tests.mutants.harness import apply
    from verify.runner.gang import Gang
    path = str(shim(Path(tempfile.mkdtemp(prefix="harness_mutant_")), name))
    start = Gang.start

    def start_with_mutant(self):
        if path not in self.modules:
            self.modules.append(path)
        return start(self)
    Gang.start = start_with_mutant
    apply(name)
