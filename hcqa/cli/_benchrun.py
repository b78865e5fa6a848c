"""``hcqa bench``: run the checkout's benchmarks, show progress, print one table of verdicts.

Theory of operation
-------------------
Each benchmark (``bench/bench_*.py``) runs as ``python -m bench.NAME [--quick]`` in its own
process, from the checkout's root: the benchmarks fork, spawn workers and set BLAS limits,
and a process of their own keeps all of that away from the runner and from each other. Its
output goes line by line into a report file (``--reports DIR``, else a fresh temporary
directory that is kept) and, with ``--verbose``, to the terminal; meanwhile a progress display
on stderr shows which benchmark runs, for how long, and its latest line, so a long benchmark
is never silent.

The benchmarks print their verdicts in a few forms (``- target X: met (detail)``,
``- X: MISSED``, ``... (target ≤ 2x: met)``, a markdown row with a ``met`` cell);
:func:`verdicts` reads them back, so the summary is one table of every target of every
benchmark with its verdict, plus a row for a benchmark that failed or printed none.

Quick runs use sizes too small to judge a target: their verdicts are shown as
``indicative`` (never MISSED), the table's caption says so, and the exit status ignores them.
A full run exits 1 when a target was missed or a benchmark failed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

__all__ = [
    "BENCHES",
    "Outcome",
    "Verdict",
    "find_checkout",
    "indicative",
    "run_benches",
    "verdicts",
]

# What ``hcqa bench`` runs, in this order, when no names are given: one module of bench/ a line.
# To add a benchmark, add its line; it must accept --quick and print verdicts (see above).
BENCHES: tuple[str, ...] = (
    "bench_signals",
    "bench_devices",
    "bench_graph",
    "bench_pipeline",
    "bench_workers",
    "bench_opencl",
    "bench_serve",
    "bench_serve_onnx",
)
STATES = ("met", "MISSED", "skipped", "n/a")


@attrs.frozen(kw_only=True)
class Verdict:
    target: str  # what was judged, with the bench's detail
    state: str  # one of STATES


@attrs.frozen(kw_only=True)
class Outcome:
    name: str
    returncode: int
    seconds: float
    report: Path
    verdicts: tuple[Verdict, ...]
    last_line: str  # the last non-empty line of output: why a failed bench failed


_LINE = re.compile(r"^(?P<before>.*?):\s*(?P<state>met|MISSED|skipped|n/a)\b(?P<after>.*)$")


def _clean(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip(" -;,.")
    return re.sub(r"^target\s+", "", text)


def verdicts(lines: Sequence[str]) -> list[Verdict]:
    """The targets judged in a benchmark's output, in order (see the module docstring)."""
    out: list[Verdict] = []
    heading = ""  # the last markdown heading: context for a bare "target: ...: met" line
    for raw in lines:
        line = raw.strip()
        if line.startswith("#"):
            heading = line.lstrip("# ").split("(")[0].strip()
            continue
        if line.startswith("|") and line.endswith("|"):  # a markdown row with a verdict cell
            cells = [c.strip() for c in line.strip("|").split("|")]
            for i, cell in enumerate(cells):
                m = re.match(r"^(met|MISSED|skipped|n/a)\b", cell)
                if m and i > 0:
                    detail = " ".join(c for c in cells[:i] if c)
                    out.append(Verdict(target=_clean(detail), state=m[1]))
                    break
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        before, after = m["before"], m["after"].strip()
        inner = re.match(r"^(?P<head>.*)\((?P<what>[^()]*target[^()]*)$", before)
        if inner:  # "hcqa p50 = 1.2x the floor (target ≤ 2x: met); p99 ..."
            target = f"{_clean(inner['head'])} ({inner['what'].strip()})"
        elif re.match(r"^-?\s*target\s*:", before):  # "target: seen within 100 ms: met"
            target = f"{heading}: {before.split(':', 1)[1]}" if heading else before
        else:
            target = f"{before} {after}" if after.startswith("(") else before
        out.append(Verdict(target=_clean(target), state=m["state"]))
    return out


def _is_checkout(root: Path) -> bool:
    return (root / "bench" / "__init__.py").is_file() and (root / "pyproject.toml").is_file()


def find_checkout(cwd: Path | None = None) -> Path | None:
    """The repository checkout whose ``bench/`` to run, or None: the one hcqa is imported from
    (an editable install), else the working directory or the nearest parent that is one."""
    import hcqa

    here = (cwd if cwd is not None else Path.cwd()).resolve()
    candidates = [Path(hcqa.__file__).resolve().parent.parent, here, *here.parents]
    return next((root for root in candidates if _is_checkout(root)), None)


def indicative(state: str) -> str:
    """How a quick run shows a verdict: never a judgement."""
    return {"met": "indicative (at target)", "MISSED": "indicative (below target)"}.get(
        state, f"indicative ({state})"
    )


def _run_one(
    name: str, root: Path, quick: bool, report: Path, echo: bool, status: list[str]
) -> Outcome:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", f"bench.{name}", *(["--quick"] if quick else [])]
    start = time.perf_counter()
    lines: list[str] = []
    with report.open("w") as log:
        proc = subprocess.Popen(
            argv,
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                lines.append(line.rstrip("\n"))
                if line.strip():
                    status[0] = line.strip()[:70]
                if echo:
                    sys.stdout.write(line)
        finally:
            proc.stdout.close()
            code = proc.wait()
    last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    return Outcome(
        name=name,
        returncode=code,
        seconds=time.perf_counter() - start,
        report=report,
        verdicts=tuple(verdicts(lines)),
        last_line=last,
    )


def run_benches(
    names: Sequence[str],
    *,
    root: Path,
    quick: bool,
    reports: Path | None = None,
    verbose: bool = False,
    progress_enabled: bool = True,
) -> tuple[list[Outcome], Path]:
    """Run ``names`` one after the other, with a progress display; (outcomes, reports dir)."""
    from hcqa.cli._console import progress

    folder = reports if reports is not None else Path(tempfile.mkdtemp(prefix="hcqa-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    with progress("benchmarks", len(names), enabled=progress_enabled and not verbose) as bar:
        for name in names:
            status = [""]
            done = threading.Event()
            start = time.perf_counter()

            def tick(
                name: str = name,
                status: list[str] = status,
                start: float = start,
                done: threading.Event = done,
            ) -> None:
                while not done.wait(0.5):  # the display's text; the bar redraws by itself
                    bar.describe(f"{name} {time.perf_counter() - start:4.0f} s  {status[0]}")

            ticker = threading.Thread(target=tick, name=f"hcqa bench {name} status", daemon=True)
            bar.describe(f"{name} starting")
            ticker.start()
            try:
                outcomes.append(
                    _run_one(name, root, quick, folder / f"{name}.txt", verbose, status)
                )
            finally:
                done.set()
                ticker.join()
            bar.advance()
    return outcomes, folder


def summary(outcomes: Sequence[Outcome], *, quick: bool, reports: Path) -> tuple[str, bool]:
    """(the summary table as text, whether a full run failed: a MISSED target or a crash)."""
    from hcqa.cli._console import render, table

    rows: list[list[str]] = []
    failed = False
    for o in outcomes:
        head = f"{o.name} ({o.seconds:.0f} s)"
        if o.returncode != 0 and not (o.verdicts and o.returncode == 1):
            failed = True
            rows.append([head, f"exited {o.returncode}: {o.last_line[:80]}", "FAILED"])
            continue
        if not o.verdicts:
            rows.append([head, "(no target judged; see its report)", "-"])
        for i, v in enumerate(o.verdicts):
            state = indicative(v.state) if quick else v.state
            failed = failed or (not quick and v.state == "MISSED")
            rows.append([head if i == 0 else "", v.target, state])
    if quick:
        caption = (
            "--quick: sizes too small to judge the targets; every verdict is indicative. "
            "Run `hcqa bench` without --quick to judge them."
        )
    else:
        caption = "each target measured against its floor or peer in the same run"
    caption += f"\nfull reports: {reports}/"
    title = "hcqa bench --quick: indicative only" if quick else "hcqa bench"
    text = render(
        table(
            ["benchmark", "target", "verdict"], rows, title=title, text_columns=3, caption=caption
        )
    )
    return text, failed
