"""Bad command-line input is one line and exit 2 before any rank starts; ``--version`` answers."""
from __future__ import annotations

import pytest

from verify.cli import main


@pytest.mark.parametrize("argv, what", [
    (["op", "linear", "--timeout", "1e-9"], "--timeout must be at least 1"),
    (["op", "linear", "--partition", ""], "--partition must not be empty"),
    (["op", "linear", "--seed", "99999999999999999999999"], "--seed must be between 0 and"),
    (["op", "linear", "--seed", "-1"], "--seed must be between 0 and"),
])
def test_bad_input_is_one_line_and_exit_2(argv, what, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and what in err[0], err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("python -m verify ")
