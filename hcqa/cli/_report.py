"""What both demos share: the verdict on a speedup, the host facts behind it, and the trace kept
only when a run finished.

Theory of operation
-------------------
:func:`verdict` turns the two sides' times into one line: too short to judge (under
``MIN_SECONDS`` a side), a win, or the likeliest reason for a loss (one core, BLAS not limited, a
busy host, one OpenCL device named twice, hand-offs costing more than the overlap);
:func:`depends` says what the figure depends on, with this run's values. :func:`report_times`
prints both sides' times, the speedup and those two lines, the same for the MLP and a model.

A run's trace is written beside its path (:func:`partial_trace`) and renamed onto it by
:func:`kept_trace` once the run has finished, so a run that fails keeps the previous trace and
leaves no partial file. :func:`check_opencl` refuses ``--device opencl`` in one line before
anything is written where PyOpenCL or an OpenCL device is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TextIO

import hcqa
from hcqa.errors import install_hint

if TYPE_CHECKING:
    from hcqa.cli._mlp import Timed

__all__ = [
    "MIN_SECONDS",
    "WARM_SECONDS",
    "check_opencl",
    "cores",
    "depends",
    "host_load",
    "kept_trace",
    "one_blas_thread",
    "partial_trace",
    "report_times",
    "trace_line",
    "trace_path_of",
    "verdict",
]

MIN_SECONDS = 0.5  # per side: below this the timings are mostly fixed costs and noise
WARM_SECONDS = 0.5  # per side, before timing (not in --quick runs)


def verdict(
    *,
    t_pipe: float,
    t_seq: float,
    cores: int,
    load: float | None,
    blas_limited: bool,
    processes: bool = False,
    shared_device: str | None = None,
) -> str:
    """One line saying what the speedup means: too short to judge, a win, or why it lost.

    ``shared_device``: the one device both stages ran on (``opencl:0`` named twice)."""
    speedup = t_seq / t_pipe if t_pipe > 0 else float("inf")
    if min(t_pipe, t_seq) < MIN_SECONDS:
        return (
            f"verdict: too short to judge ({t_pipe * 1e3:.0f} ms vs {t_seq * 1e3:.0f} ms, under "
            f"{MIN_SECONDS} s a side: fixed costs and noise dominate); run without --quick or "
            "with more --batches"
        )
    if speedup >= 1.0 and shared_device is not None:
        return (
            f"verdict: the pipeline did {speedup:.2f}x the 1-device throughput; both stages ran "
            f"on one OpenCL device ({shared_device} named twice) and shared its compute units, "
            "so about 1x is what to expect"
        )
    if speedup >= 1.0:
        return (
            f"verdict: the pipeline did {speedup:.2f}x the 1-device throughput (two equal "
            "stages on two free cores can approach 2x)"
        )
    hop = "worker processes" if processes else "devices"
    if shared_device is not None:
        why = (
            f"both stages ran on one OpenCL device ({shared_device} named twice), so they "
            "shared its compute units and could not overlap; the run shows the two devices "
            "agree with numpy, not a speedup"
        )
    elif cores < 2:
        why = f"only {cores} core is available to this process, so the two stages cannot overlap"
    elif not blas_limited:
        why = (
            f"BLAS threads are not limited ({install_hint('demo')}), so the 1-device run "
            "already used several cores"
        )
    elif load is not None and load > cores:
        why = (
            f"the host was busy (1-minute load average {load:.1f} on {cores} cores at the start), "
            "so the two stages competed with other work for the cores"
        )
    else:
        why = (
            f"handing each microbatch between {hop} cost more than the overlap saved at this "
            "size; try a larger --batch-size or --hidden"
        )
    return f"verdict: the pipeline lost ({speedup:.2f}x): {why}"


def depends(
    *,
    cores: int,
    blas_limited: bool | None,
    load: float | None,
    shared_device: str | None = None,
) -> str:
    """What the speedup depends on, with this run's values: free cores, BLAS threads, load.

    ``shared_device``: the one OpenCL device both stages ran on, where BLAS has no part;
    ``blas_limited=None``: the stages call no BLAS (a model's own kernels)."""
    busy = f"1-minute load average {load:.1f} at the start" if load is not None else "unknown"
    if shared_device is not None:
        return (
            f"the figure depends on {shared_device}'s compute units, which both stages share, "
            f"and the host's other load ({busy}); on a busy or shared host it varies from "
            "run to run"
        )
    if blas_limited is None:
        return (
            f"the figure depends on free cores (the two stages need two: {cores} here) and the "
            f"host's other load ({busy}); on a busy or shared host it varies from run to run"
        )
    blas = "1 per device" if blas_limited else "not limited"
    return (
        f"the figure depends on free cores (the two stages need two: {cores} here), BLAS "
        f"threads ({blas}) and the host's other load ({busy}); on a busy or shared host it "
        "varies from run to run"
    )


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def one_blas_thread() -> tuple[Callable[[], contextlib.AbstractContextManager[object]], bool]:
    """(a factory of contexts holding BLAS to one thread, whether they do).

    A factory, not one context: threadpoolctl applies its limit when the object is made and
    lifts it on the first exit, so entering the same object twice would run the second block
    -- the check against numpy -- with BLAS unlimited, whose sums differ in the last bit.
    threadpoolctl is the optional ``demo`` extra; without it BLAS keeps its own pool,
    which competes with the devices for the cores, and the demo says so."""
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
    except ImportError:
        return contextlib.nullcontext, False
    return lambda: threadpool_limits(1), True


def check_opencl() -> None:
    """``--device opencl`` refused in one line before anything is written (the weights,
    the trace) where PyOpenCL or an OpenCL device is missing."""
    from hcqa.cli._base import CliError
    from hcqa.devices.opencl import platforms

    try:
        devices = platforms.list_devices()
    except platforms.OpenCLMissing as exc:
        raise CliError(f"--device opencl needs PyOpenCL and an OpenCL driver: {exc}") from None
    except Exception as exc:  # a broken driver install: its own words
        raise CliError(f"--device opencl: listing the OpenCL devices failed: {exc}") from None
    if not devices:
        raise CliError(
            f"--device opencl needs an OpenCL device (got none; {platforms.INSTALL_HINT} "
            "brings PoCL, which runs on any CPU)"
        )


def partial_trace(path: str) -> str:
    """Where the run's trace is written before it is renamed onto ``path`` on success, so
    a failed run never replaces the previous good trace (beside it: same file system)."""
    hcqa.Tracer(path)  # refuses a path that can't be written, now
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}.partial")


@contextlib.contextmanager
def kept_trace(partial: str | None, path: str | None) -> Iterator[None]:
    """Rename ``partial`` onto ``path`` when the block finishes; remove it when it raises
    (the previous trace at ``path`` stays as it was)."""
    try:
        yield
    except BaseException:
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        raise
    if partial is not None and path is not None:
        os.replace(partial, path)


def trace_line(path: str | None, note: str = "") -> str:
    """The output's last line: where the trace is and how to read it."""
    if path is None:
        return "  trace: not written (--no-trace)\n"
    return (
        f"  trace: {path}{note}; read it with hcqa trace summary {path}, "
        "hcqa trace plot, or ui.perfetto.dev\n"
    )


def report_times(
    out: TextIO,
    timed: Timed,
    batches: int,
    *,
    blas_limited: bool | None,
    load: float | None,
    processes: bool = False,
    shared_device: str | None = None,
) -> None:
    """Both sides' times and rates, the speedup with its halves, what it depends on, and the
    verdict."""
    width = max(len(timed.pipe_label), len(timed.seq_label))
    for name, secs in ((timed.pipe_label, timed.t_pipe), (timed.seq_label, timed.t_seq)):
        out.write(f"  {name:<{width}}: {secs:7.3f} s  {batches / secs:8.1f} microbatches/s\n")
    first, second = timed.halves
    out.write(
        f"  speedup: {timed.t_seq / timed.t_pipe:.2f}x (sequential time / pipeline time; timed "
        f"A B B A after a warm-up, halves {first:.2f}x and {second:.2f}x)\n"
    )
    n = cores()
    said = depends(cores=n, blas_limited=blas_limited, load=load, shared_device=shared_device)
    out.write(f"  {said}\n")
    line = verdict(
        t_pipe=timed.t_pipe,
        t_seq=timed.t_seq,
        cores=n,
        load=load,
        blas_limited=blas_limited is not False,  # no BLAS: never the reason for a loss
        processes=processes,
        shared_device=shared_device,
    )
    out.write(f"  {line}\n")


def trace_path_of(args: argparse.Namespace) -> str | None:
    """Where the run's trace goes: ``--trace``, else ``$HCQA_TRACE``, else
    ``hcqa-demo-trace.json``; None with ``--no-trace``."""
    if args.no_trace:
        return None
    return str(args.trace or os.environ.get("HCQA_TRACE") or "hcqa-demo-trace.json")
