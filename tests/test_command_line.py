"""The ``lightning-ddp-amp`` command line: its subcommands, help, version and mistakes (commands/main.py)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from lightning_ddp_amp.commands import main as command_line


@pytest.mark.parametrize(("argv", "code"), [([], 2), (["--help"], 0), (["-h"], 0)])
def test_no_arguments_and_help_list_every_subcommand(
    argv: list[str], code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert command_line.main(argv) == code
    said = capsys.readouterr()
    text = said.out + said.err
    for name in ("env", "compare"):
        assert f"\n  {name} " in text
    assert "--version" in text


@pytest.mark.parametrize(("typo", "nearest"), [("compar", "compare"), ("evn", "env"), ("doctor", None)])
def test_a_mistyped_subcommand_is_named_with_the_nearest_one_and_every_subcommand(
    typo: str, nearest: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert command_line.main([typo]) == 2
    error = capsys.readouterr().err
    hint = f"; did you mean {nearest!r}?" if nearest else ""
    assert error.startswith(f"lightning-ddp-amp: {typo!r} is not a command{hint}\n")
    assert "\n  compare " in error and "\n  env " in error


def test_version_names_the_package_torch_and_lightning(capsys: pytest.CaptureFixture[str]) -> None:
    assert command_line.main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    package = importlib.metadata.version("lightning-ddp-amp")
    lightning = importlib.metadata.version("lightning")
    assert line == f"lightning-ddp-amp {package} (torch {torch.__version__}, lightning {lightning})"


def test_the_old_launchers_local_rank_still_reaches_the_environment_report(capsys: pytest.CaptureFixture[str]) -> None:
    command_line.main(["--local-rank=0", "env", "--json"])
    assert '"launcher"' in capsys.readouterr().out
