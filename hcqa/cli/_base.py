"""What every ``hcqa`` subcommand shares: the error type, the parser, the output line,
and the trio runner that honours ``HCQA_TRACE``."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

__all__ = ["PROG", "CliError", "Command", "run_trio"]

PROG = "hcqa"


class CliError(Exception):
    """An error meant for the user: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


@dataclass(frozen=True)
class Command:
    """One subcommand: ``configure`` adds its arguments, ``run`` executes it."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _out(line: str = "", stream: TextIO | None = None) -> None:
    print(line, file=stream if stream is not None else sys.stdout)


def run_trio(async_fn: Callable[..., Any], *args: Any) -> Any:
    """``trio.run(async_fn, *args)`` with ``hcqa.Tracer($HCQA_TRACE)`` when that is set.

    CLI commands that run trio call this, so ``HCQA_TRACE=t.json hcqa ...`` traces them."""
    import trio

    from hcqa.trace import instruments_from_env

    instruments = instruments_from_env()
    try:
        return trio.run(async_fn, *args, instruments=instruments)
    finally:
        for tracer in instruments:
            _out(f"{PROG}: trace written to {getattr(tracer, 'path', '?')}", sys.stderr)


_TRACEBACK_HELP = "on an error, print the full traceback too (or set HCQA_DEBUG=1)"


def _debug() -> _Parser:
    """A parent parser with ``--traceback``, so it is accepted after any subcommand too."""
    debug = _Parser(add_help=False)
    debug.add_argument(
        "--traceback",
        action="store_true",
        default=argparse.SUPPRESS,  # a subcommand's default must not undo the top level's flag
        help=_TRACEBACK_HELP,
    )
    return debug
