"""The ``hcqa`` command.

Each subcommand is a :class:`Command` in :data:`COMMANDS`: a one-line help, a function that adds
its arguments to its parser, and a function that runs it and returns the exit status. To add one
(``demo``, ``bench``, ``trace summary``, ...), write those two functions and add an entry;
a long one gets its own module (``serve.py``). ``_base.py`` holds what they share.

Errors are one line on stderr and exit status 2, never a traceback -- unless ``--traceback``
is given or ``HCQA_DEBUG=1`` is set, which print the traceback above that line; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys

from hcqa.cli._base import (
    _TRACEBACK_HELP,
    PROG,
    CliError,
    Command,
    _debug,
    _out,
    _Parser,
    _version,
    run_trio,
)
from hcqa.cli._cuda import cuda_rows
from hcqa.cli._opencl import opencl_rows
from hcqa.cli.serve import configure_serve, run_serve
from hcqa.errors import install_hint

__all__ = ["COMMANDS", "CliError", "Command", "main", "run_trio"]

# ---------------------------------------------------------------------------------------------
# info helpers


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
        (
            "devices",
            f"cpu:N (any N; {os.cpu_count() or 1} cores), cuda:N and opencl:N (listed below)",
        ),
        *cuda_rows(),
        *opencl_rows(),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        _out(f"{name + ':':<{width + 1}} {value}")
    return 0


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    from hcqa.cli import demo

    demo.configure(parser)


def _run_demo(args: argparse.Namespace) -> int:
    from hcqa.cli import demo

    return demo.run(args)


def _configure_bench(parser: argparse.ArgumentParser) -> None:
    from hcqa.cli._benchrun import BENCHES

    parser.add_argument(
        "--quick", action="store_true", help="short runs: indicative only, never judge targets"
    )
    parser.add_argument("--reports", metavar="DIR", help="keep each full report in DIR/NAME.txt")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="stream every report (no progress display)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"only these ({', '.join(BENCHES)}; default all)"
    )


def _run_bench(args: argparse.Namespace) -> int:
    """Run each ``bench/bench_*.py`` of the checkout (``hcqa.cli._benchrun``); one table of every
    target's verdict. Exit 1 when a full run missed a target or a benchmark failed."""
    from pathlib import Path

    from hcqa.cli._benchrun import BENCHES, find_checkout, run_benches, summary

    root = find_checkout()
    if root is None:
        raise CliError(
            "hcqa bench runs the benchmarks of a repository checkout (its bench/ folder): "
            "install hcqa from one with pip install -e . or run hcqa bench inside one"
        )
    unknown = [n for n in args.names if n not in BENCHES and f"bench_{n}" not in BENCHES]
    if unknown:
        raise CliError(f"unknown benchmark {unknown[0]!r} (known: {', '.join(BENCHES)})")
    wanted = [n if n in BENCHES else f"bench_{n}" for n in args.names] or list(BENCHES)
    missing = [n for n in wanted if not (root / "bench" / f"{n}.py").is_file()]
    if missing:
        raise CliError(f"{missing[0]} is not in this checkout ({root / 'bench'})")
    what = "quick runs (indicative only)" if args.quick else "full runs"
    _out(f"{PROG} bench: {len(wanted)} benchmark(s), {what}: {', '.join(wanted)}")
    sys.stdout.flush()
    outcomes, folder = run_benches(
        wanted,
        root=root,
        quick=args.quick,
        reports=Path(args.reports) if args.reports else None,
        verbose=args.verbose,
        progress_enabled=not args.no_progress,
    )
    text, failed = summary(outcomes, quick=args.quick, reports=folder)
    _out()
    _out(text)
    return 1 if failed else 0


def _configure_trace(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    summary = sub.add_parser(
        "summary", help="per-device busy %%, per-program times, bandwidth", parents=[_debug()]
    )
    summary.add_argument("file", help="a trace JSON file written by hcqa.Tracer")
    plot = sub.add_parser("plot", help="draw a timeline PNG (needs matplotlib)", parents=[_debug()])
    plot.add_argument("file", help="a trace JSON file written by hcqa.Tracer")
    plot.add_argument("-o", "--output", default=None, help="the PNG to write (default FILE.png)")
    plot.add_argument(
        "--flows",
        choices=("sample", "all", "none"),
        default="sample",
        help="cross-queue waits to draw: an even sample of --max-flows (default), all, or none",
    )
    plot.add_argument("--max-flows", type=int, default=200, help="the sample's size (default 200)")
    plot.add_argument("--max-tasks", type=int, default=8, help="trio task rows (default 8)")
    plot.add_argument(
        "--from",
        dest="start_ms",
        type=_time_ms,
        metavar="TIME",
        help="zoom: start at TIME since the trace's first range, as on the plot's axis "
        "(4.2s, 350ms, 120us; a bare number is ms)",
    )
    plot.add_argument(
        "--to", dest="end_ms", type=_time_ms, metavar="TIME", help="zoom: end at TIME"
    )
    plot.add_argument(
        "--region", metavar="NAME", help="zoom on a region of the trace (hcqa.trace.region)"
    )


def _time_ms(text: str) -> float:
    """``--from`` / ``--to``: a time with an optional unit (s, ms, us), in ms."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*(s|ms|us|µs)?\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"must be a time such as 4.2s, 350ms or 120us (got {text!r})"
        )
    return float(m[1]) * {"s": 1e3, "ms": 1.0, "us": 1e-3, "µs": 1e-3}[m[2] or "ms"]


def _run_trace(args: argparse.Namespace) -> int:
    from hcqa import trace

    try:
        doc = trace.load(args.file)
    except trace.TraceFormatError as exc:
        raise CliError(str(exc)) from exc
    except OSError as exc:
        raise CliError(f"cannot read trace {args.file!r}: {exc.strerror or exc}") from exc
    if args.action == "summary":
        _out(trace.summarize(doc))
        _out(f"\n{_PERFETTO.format(file=args.file)}")
        return 0
    for name in ("max_flows", "max_tasks"):
        if getattr(args, name) < 0:
            raise CliError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(args, name)})")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(f"trace plot needs matplotlib: {install_hint('plot')}") from None
    out = args.output or f"{os.path.splitext(args.file)[0]}.png"
    try:
        info = trace.plot(
            doc,
            out,
            flows=args.flows,
            max_flows=args.max_flows,
            max_tasks=args.max_tasks,
            start_ms=args.start_ms,
            end_ms=args.end_ms,
            region=args.region,
        )
    except ValueError as exc:
        raise CliError(str(exc).replace("'region'", "--region")) from exc
    _out(f"wrote {out}: {info.title.replace(chr(10), '; ')}")
    if info.regions:
        names = ", ".join(repr(n) for n in dict.fromkeys(info.regions))
        _out(f"regions: {names} (zoom on one with --region NAME)")
    if info.busy_share < SPARSE:
        _out(
            f"the device queues were busy {_share(info.busy_share)} of the plotted "
            f"{info.window[1] - info.window[0]:.6g} ms: the work is in short bursts, too thin "
            "to see at this scale; zoom in with --from TIME --to TIME (as on the axis: "
            "--from 4.2s --to 4.5s) or --region NAME"
        )
    _out(_PERFETTO.format(file=args.file))
    return 0


SPARSE = 0.05  # below this busy share of the plotted time, the plot says how to zoom in


def _share(x: float) -> str:
    return f"{100 * x:.1f}%" if x >= 0.001 else "under 0.1%"


_PERFETTO = (
    "to zoom, pan and inspect every event: open {file} at https://ui.perfetto.dev ('Open trace "
    "file'; it is read in your browser, not uploaded)"
)


COMMANDS: dict[str, Command] = {
    "info": Command(
        help="print versions, the C compiler and the available devices",
        configure=_configure_info,
        run=_run_info,
    ),
    "demo": Command(
        help="run an MLP (or --model squeezenet) as a 2-stage pipeline over cpu:0 and cpu:1; "
        "check it, time it, trace it",
        configure=_configure_demo,
        run=_run_demo,
    ),
    "bench": Command(
        help="run the benchmarks under bench/ (repository checkout): one table of verdicts",
        configure=_configure_bench,
        run=_run_bench,
    ),
    "trace": Command(
        help="read a trace written by hcqa.Tracer: 'summary FILE' or 'plot FILE -o OUT.png'",
        configure=_configure_trace,
        run=_run_trace,
    ),
    "serve": Command(
        help="serve ONNX models (--model NAME=PATH.onnx) or a demo 2-stage MLP over HTTP with "
        "dynamic batching: the Open Inference Protocol (/v2), /infer, /health, /stats, /metrics",
        configure=configure_serve,
        run=run_serve,
    ),
}


# ---------------------------------------------------------------------------------------------
# entry point


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="hcqa: an asynchronous, actor-based scheduler for accelerator command queues.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {_version('hcqa')}")
    parser.add_argument("--traceback", action="store_true", help=_TRACEBACK_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        parents = [_debug()]
        child = sub.add_parser(name, help=command.help, description=command.help, parents=parents)
        command.configure(child)
    return parser


def _debug_env() -> bool:
    return os.environ.get("HCQA_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what the closed pipe did
    not take raises nothing at exit (as Python's docs on SIGPIPE advise)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture)
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the ``hcqa`` command line; returns the exit status."""
    import traceback

    parser = _parser()
    args = None
    try:
        args = parser.parse_args(argv)
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        if getattr(args, "traceback", False) or _debug_env():
            traceback.print_exc()
        _out(f"{PROG}: interrupted", sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (hcqa trace summary FILE | head): stop quietly
        _discard_stdout()
        return 1
    except Exception as exc:  # one clear line; the traceback only on request
        show = getattr(args, "traceback", False) or _debug_env()
        if show:
            traceback.print_exc()
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, CliError):
            message = f"{type(exc).__name__}: {message}"
            if not show:
                message += " (--traceback or HCQA_DEBUG=1 shows where)"
        _out(f"{PROG}: error: {message}", sys.stderr)
        return 2
