"""The ``hcqa`` command.

Each subcommand is a :class:`Command` in :data:`COMMANDS`: a one-line help, a function that adds
its arguments to its parser, and a function that runs it and returns the exit status. To add one
(``demo``, ``bench``, ``trace summary``, ...), write those two functions and add an entry.

Errors are one line on stderr and exit status 2, never a traceback; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

__all__ = ["COMMANDS", "Command", "main"]

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


# ---------------------------------------------------------------------------------------------
# helpers


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _out(line: str = "", stream: TextIO | None = None) -> None:
    print(line, file=stream if stream is not None else sys.stdout)


def _compiler() -> str:
    """The C compiler hcqa would use (``$CC`` or ``cc``) and its version line."""
    cc_env = os.environ.get("CC", "").strip()
    if cc_env:
        cmd = shlex.split(cc_env)
        source = "$CC"
    else:
        found = shutil.which("cc")
        if found is None:
            return "not found (set CC or install a C compiler to compile C programs)"
        cmd = [found]
        source = "cc"
    exe = shutil.which(cmd[0])
    if exe is None:
        return f"{cmd[0]!r} from {source} not found on PATH"
    try:
        proc = subprocess.run(
            [*cmd, "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{exe} (could not run --version: {exc})"
    first = (proc.stdout or proc.stderr).strip().splitlines()
    version = first[0] if first else f"--version exited {proc.returncode}"
    return f"{exe} ({version})"


def _cuda() -> str:
    """Whether the CUDA driver bindings are installed and the driver answers."""
    try:
        driver: Any = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        return "not installed (pip install hcqa[cuda])"
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"bindings installed, but cuInit failed: {err!r}"
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"bindings installed, but cuDeviceGetCount failed: {err!r}"
    except Exception as exc:
        return f"bindings installed, but the driver did not answer: {exc}"
    return f"usable, {count} device(s)"


# ---------------------------------------------------------------------------------------------
# subcommands


def _configure_info(parser: argparse.ArgumentParser) -> None:
    del parser  # no options yet


def _run_info(args: argparse.Namespace) -> int:
    del args
    rows = [
        ("hcqa", _version("hcqa")),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("trio", _version("trio")),
        ("attrs", _version("attrs")),
        ("numpy", _version("numpy")),
        ("platform", platform.platform()),
        ("cc", _compiler()),
        ("devices", f"cpu:N (any N; {os.cpu_count() or 1} cores)"),
        ("cuda", _cuda()),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        _out(f"{name + ':':<{width + 1}} {value}")
    return 0


COMMANDS: dict[str, Command] = {
    "info": Command(
        help="print versions, the C compiler and the available devices",
        configure=_configure_info,
        run=_run_info,
    ),
}


# ---------------------------------------------------------------------------------------------
# entry point


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="hcqa: an asynchronous, actor-based scheduler for accelerator command queues.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version('hcqa')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        child = sub.add_parser(name, help=command.help, description=command.help)
        command.configure(child)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``hcqa`` command line; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        _out(f"{PROG}: interrupted", sys.stderr)
        return 130
    except Exception as exc:  # one clear line, no traceback
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, CliError):
            message = f"{type(exc).__name__}: {message}"
        _out(f"{PROG}: error: {message}", sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
