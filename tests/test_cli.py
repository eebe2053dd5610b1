"""The command line: user mistakes are one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse

import pytest
import torch

from fuser.cli import build_parser, main


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


def test_a_build_out_of_memory_is_one_clear_line(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    """A build that runs out of GPU memory (fuser/pipeline.py names what to lower) ends
    `fuser build` with that one line and exit status 2."""
    import fuser.cli

    def out_of_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("the target's steps ran out of GPU memory: lower kv_blocks=9")

    monkeypatch.setattr(fuser.cli, "build_engine_from_args", out_of_memory)
    assert main(["build", str(tmp_path / "model"), "--out", str(tmp_path / "engine")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fuser: error: the target's steps ran out of GPU memory: lower kv_blocks=9"]


def test_unknown_command_exits_with_usage(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_of_every_subcommand_has_help() -> None:
    commands = _subcommands()
    assert {"build", "generate", "bench", "inspect", "demo", "export"} <= set(commands)
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help and action.help is not argparse.SUPPRESS, (
                f"fuser {name}: {action.option_strings or action.dest} has no help line")


@pytest.mark.parametrize("command", ["build", "generate", "bench", "inspect", "demo", "export"])
def test_help_lists_each_option_with_its_help(command: str,
                                              capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for action in _subcommands()[command]._actions:
        assert action.help.split("%(")[0].split()[0] in text


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture) -> None:
    import fuser

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"fuser {fuser.__version__}"
    assert lines[1] == f"torch {torch.__version__}"
    assert any(line.startswith("triton ") for line in lines)
    assert any(line.startswith("transformers ") for line in lines)
