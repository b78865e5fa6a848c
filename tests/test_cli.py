"""The ``hcqa`` command's own behaviour: version, errors as one line, tracebacks on request."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

import pytest

from hcqa import cli


def _boom(args: argparse.Namespace) -> int:
    raise RuntimeError("the engine fell over\nsecond line")


@pytest.fixture
def broken_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hcqa info`` replaced by a command that fails unexpectedly."""
    old = cli.COMMANDS["info"]
    monkeypatch.setitem(
        cli.COMMANDS, "info", cli.Command(help=old.help, configure=old.configure, run=_boom)
    )
    monkeypatch.delenv("HCQA_DEBUG", raising=False)


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([flag])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"hcqa {importlib.metadata.version('hcqa')}\n"


def test_an_unexpected_error_is_one_line_that_says_how_to_see_more(
    broken_info: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "hcqa: error: RuntimeError: the engine fell over "
        "(--traceback or HCQA_DEBUG=1 shows where)\n"
    )


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--traceback", "info"], None), (["info", "--traceback"], None), (["info"], "1")],
)
def test_traceback_on_request(
    argv: list[str],
    env: str | None,
    broken_info: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if env is not None:
        monkeypatch.setenv("HCQA_DEBUG", env)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "in _boom" in err and "RuntimeError: the engine fell over" in err
    assert err.endswith("hcqa: error: RuntimeError: the engine fell over\n")


@pytest.mark.parametrize("value", ["", "0", "no"])
def test_hcqa_debug_off_values(
    value: str,
    broken_info: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HCQA_DEBUG", value)
    assert cli.main(["info"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_traceback_after_a_nested_subcommand(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["trace", "summary", "--traceback", "/nonexistent/t.json"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith(
        "hcqa: error: cannot read trace '/nonexistent/t.json': No such file or directory\n"
    )


def test_the_installed_command_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hcqa.cli", "-V"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.startswith("hcqa ")
