"""The command line: user mistakes are one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import pytest

from fuser.cli import main


@pytest.mark.parametrize("argv", [
    ["generate", "/no/such/model", "--prompt", "x"],
    ["bench", "/no/such/model"],
    ["build", "/no/such/model", "--out", "x"],
    ["inspect", "engine"],
])
def test_user_mistakes_are_one_clear_line(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fuser: error: ")
    assert "Traceback" not in err[0]


def test_unknown_command_exits_with_usage(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
