"""``hcqa demo``: an MLP split over two cpu devices as a two-stage Pipeline.

Theory of operation
-------------------
The demo generates a ``layers``-deep MLP (square ``hidden x hidden`` float32 weights plus
biases, ReLU after every layer; seeded, so every run computes the same thing), writes all
weights to one file, and loads each array back into device buffers with
``Buffer.load(path, offset=, nbytes=)``: the file goes straight into device memory through the
copy engines. The first half of the layers becomes stage 1 on ``cpu:0``, the second half
stage 2 on ``cpu:1``; each stage is a Python callable doing ``np.matmul(..., out=)``, the bias
add and the ReLU in place, so it allocates nothing per call. A second, one-stage pipeline runs
every layer on ``cpu:0``: the sequential single-device baseline for the same work, at the same
depth, so the only difference is the number of devices.

BLAS is held to one thread (``threadpoolctl.threadpool_limits(1)``, the ``demo`` extra;
without it the demo says so) for the whole run, so the
devices -- each with its own engine thread -- are the unit of parallelism, and two stages on
two devices can approach 2x the sequential throughput on two cores.

``drive`` keeps ``depth`` worker tasks (named ``"pipeline 1-64 worker 2"``, so a trace reads
well) pulling microbatch indices, so exactly ``depth`` microbatches are in flight and every
completion ticks the progress bar (rich, on stderr, only on a tty). Both sides are warmed
up first: ``2 * depth`` microbatches, again and again until the side has run for
``WARM_SECONDS`` (fresh slots and pages, BLAS's first calls, the cores ramping up: costs that a
first run in a fresh process would otherwise charge to the side timed first). Then they are
timed A B B A (each runs half the batches early and half late), so a drift in the host's load
-- shared machines vary a lot -- hits both alike; the output gives each half's speedup and
what the figure depends on (free cores, BLAS threads, the host's load). :func:`verdict` turns
the two times into one line: too short to judge (under half a second a side), a win, or the
likeliest reason for a loss (one core, BLAS not limited, a busy host, hand-offs costing more
than the overlap).

``--processes`` runs the two stages in worker processes (``hcqa.processes``); its baseline is the
same one-stage pipeline on a ``cpu:0`` device of this process, so it runs on an engine thread
(never on the event loop) and shows in the trace, while the workers' own runs do not (the
tracer sees this process only, and the output says so).

Every output of the pipeline is compared with the sequential run's, and a sample with a numpy
reference computed on the host by the same kernel code; the largest absolute error against
numpy is reported and a mismatch exits with status 1.

The whole run is one ``trio.run``; :class:`hcqa.Tracer` is installed as an instrument and
writes a Chrome trace (``--trace PATH``, else ``$HCQA_TRACE``, else ``hcqa-demo-trace.json``;
``--no-trace`` for none; read it with ``hcqa trace summary|plot`` or https://ui.perfetto.dev).
The trace goes to a file beside PATH and is renamed onto it once the run has finished, so a
run that fails keeps the previous trace; ``--device opencl`` checks for PyOpenCL and a device
before it writes anything.
:mod:`bench.bench_pipeline` reuses the building blocks here for its timed comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable

import numpy as np
import trio

import hcqa
from hcqa.cli._mlp import (
    F32,
    FULL,
    QUICK,
    WARM_PASSES,
    Layout,
    MlpSpec,
    Timed,
    build_pipelines,
    drive,
    load_params,
    make_inputs,
    make_weights,
    mlp_kernel,
    mlp_stage,
    run_processes,
    run_threads,
    save_weights,
)
from hcqa.errors import install_hint

__all__ = [
    "F32",
    "FULL",
    "MIN_SECONDS",
    "QUICK",
    "WARM_PASSES",
    "WARM_SECONDS",
    "Layout",
    "MlpSpec",
    "Timed",
    "build_pipelines",
    "configure",
    "depends",
    "drive",
    "load_params",
    "make_inputs",
    "make_weights",
    "mlp_kernel",
    "mlp_stage",
    "run",
    "run_processes",
    "run_threads",
    "save_weights",
    "verdict",
]


# ---------------------------------------------------------------------------------------------
# the verdict

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
    *, cores: int, blas_limited: bool, load: float | None, shared_device: str | None = None
) -> str:
    """What the speedup depends on, with this run's values: free cores, BLAS threads, load.

    ``shared_device``: the one OpenCL device both stages ran on, where BLAS has no part."""
    busy = f"1-minute load average {load:.1f} at the start" if load is not None else "unknown"
    if shared_device is not None:
        return (
            f"the figure depends on {shared_device}'s compute units, which both stages share, "
            f"and the host's other load ({busy}); on a busy or shared host it varies from "
            "run to run"
        )
    blas = "1 per device" if blas_limited else "not limited"
    return (
        f"the figure depends on free cores (the two stages need two: {cores} here), BLAS "
        f"threads ({blas}) and the host's other load ({busy}); on a busy or shared host it "
        "varies from run to run"
    )


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# the command


def configure(parser: argparse.ArgumentParser) -> None:
    f = FULL
    add = parser.add_argument
    add("--batches", type=int, help=f"microbatches to run (default {f.batches})")
    add("--batch-size", type=int, help=f"rows per microbatch (default {f.batch_size})")
    add("--hidden", type=int, help=f"layer width (default {f.hidden})")
    add("--depth", type=int, default=3, help="microbatches in flight (default 3)")
    add("--quick", action="store_true", help="a tiny run (about a second), for tests")
    add(
        "--device",
        choices=("cpu", "opencl"),
        default="cpu",
        help="cpu: numpy stages on cpu:0 and cpu:1 (default); opencl: the layers as OpenCL "
        "kernels on two hcqa devices on opencl:0 (pip install -e '.[opencl]')",
    )
    add(
        "--processes",
        action="store_true",
        help="run each stage in its own worker process (shared memory + signals)",
    )
    add("--no-progress", action="store_true", help="no progress bar (off anyway if not a tty)")
    add("--workdir", help="where to write the weights file (default: a temporary directory)")
    trace = parser.add_mutually_exclusive_group()
    trace.add_argument(
        "--trace",
        metavar="PATH",
        help="Chrome trace file to write (default: $HCQA_TRACE, else hcqa-demo-trace.json)",
    )
    trace.add_argument("--no-trace", action="store_true", help="write no trace")


def _spec(args: argparse.Namespace) -> MlpSpec:
    from hcqa.cli import _mlp_opencl
    from hcqa.cli._base import CliError

    opencl = args.device == "opencl"
    base = QUICK if args.quick else (_mlp_opencl.FULL if opencl else FULL)
    spec = MlpSpec(
        batches=args.batches if args.batches is not None else base.batches,
        batch_size=args.batch_size if args.batch_size is not None else base.batch_size,
        hidden=args.hidden if args.hidden is not None else base.hidden,
    )
    for name, value in (
        ("--batches", spec.batches),
        ("--batch-size", spec.batch_size),
        ("--hidden", spec.hidden),
        ("--depth", args.depth),
    ):
        if value < 1:
            raise CliError(f"{name} must be >= 1 (got {value})")
    if opencl:
        if args.processes:
            raise CliError(
                "--processes runs numpy stages in worker processes: not with --device opencl"
            )
        why = _mlp_opencl.check_spec(spec)
        if why is not None:
            raise CliError(why)
    return spec


def _one_blas_thread() -> tuple[Callable[[], contextlib.AbstractContextManager[object]], bool]:
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


def _check_opencl() -> None:
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


def _partial_trace(path: str) -> str:
    """Where the run's trace is written before it is renamed onto ``path`` on success, so
    a failed run never replaces the previous good trace (beside it: same file system)."""
    hcqa.Tracer(path)  # refuses a path that can't be written, now
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}.partial")


def run(args: argparse.Namespace) -> int:
    from hcqa.cli._console import progress

    spec = _spec(args)
    opencl = args.device == "opencl"
    if opencl:
        _check_opencl()
    out = sys.stdout
    mib = 4 * spec.layers * (spec.hidden + 1) * spec.hidden / 2**20
    out.write(
        f"hcqa demo: {spec.layers}-layer MLP, hidden {spec.hidden}, float32, "
        f"{spec.batches} microbatches of {spec.batch_size} rows\n"
    )
    trace_path = None
    if not args.no_trace:
        trace_path = args.trace or os.environ.get("HCQA_TRACE") or "hcqa-demo-trace.json"
    partial = _partial_trace(trace_path) if trace_path else None
    instruments: list[trio.abc.Instrument] = [hcqa.Tracer(partial)] if partial else []
    weights, xs = make_weights(spec), make_inputs(spec)
    load_before = _load()  # the host's load before the demo adds its own
    warm = min(spec.batches, 2 * args.depth)  # fills the pipeline, touches every slot
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="hcqa-"))
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "mlp-weights.bin")
        layout = save_weights(weights, path)
        out.write(f"  weights: {mib:.1f} MiB written to {path}, loaded with Buffer.load\n")
        out.flush()
        blas, blas_limited = _one_blas_thread()
        steps = 2 * (warm + spec.batches)
        with blas(), progress("starting", steps, enabled=not args.no_progress) as bar:
            body = run_processes if args.processes else run_threads
            warm_seconds = 0.0 if args.quick else WARM_SECONDS
            if opencl:
                from hcqa.cli._mlp_opencl import run_opencl

                body = run_opencl
            try:
                timed = trio.run(
                    body,
                    spec,
                    path,
                    layout,
                    args.depth,
                    xs,
                    bar,
                    warm,
                    warm_seconds,
                    instruments=instruments,
                )
            except BaseException:
                if partial is not None:  # the previous trace at trace_path stays as it was
                    with contextlib.suppress(OSError):
                        os.unlink(partial)
                raise
            if partial is not None and trace_path is not None:
                os.replace(partial, trace_path)
        half = spec.layers // 2
        where = ("worker 1", "worker 2") if args.processes else ("cpu:0", "cpu:1")
        blas_note = (
            "BLAS limited to 1 thread per device"
            if blas_limited
            else f"BLAS threads NOT limited ({install_hint('demo')} adds threadpoolctl)"
        )
        if opencl:
            where = ("device 1 (opencl:0)", "device 2 (opencl:0)")
            blas_note = "numpy computes only the reference"
        out.write(
            f"  pipeline: {timed.pipe_desc}: {where[0]} runs layers 1-{half}, {where[1]} layers "
            f"{half + 1}-{spec.layers}; {blas_note}\n"
        )
        with blas():
            sample = sorted({*range(0, spec.batches, max(1, spec.batches // 8)), spec.batches - 1})
            kernel = mlp_kernel(spec.layers, spec.batch_size, spec.hidden)
            errors: list[float] = []
            for i in sample:
                ref = np.empty_like(xs[i])
                kernel(ref, xs[i], *weights)
                errors.append(float(np.max(np.abs(timed.got[i] - ref))))
    got, want = timed.got, timed.want
    worst = max(errors)
    scale = max(1.0, max(float(np.max(np.abs(g))) for g in got))
    ok = worst <= 1e-4 * scale and all(
        np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want, strict=True)
    )
    out.write(
        f"  check: {len(sample)} outputs vs numpy, max abs error {worst:.3g}; all "
        f"{spec.batches} vs the 1-device run: {'ok' if ok else 'WRONG'}\n"
    )
    width = max(len(timed.pipe_label), len(timed.seq_label))
    for name, secs in ((timed.pipe_label, timed.t_pipe), (timed.seq_label, timed.t_seq)):
        out.write(f"  {name:<{width}}: {secs:7.3f} s  {spec.batches / secs:8.1f} microbatches/s\n")
    first, second = timed.halves
    out.write(
        f"  speedup: {timed.t_seq / timed.t_pipe:.2f}x (sequential time / pipeline time; timed "
        f"A B B A after a warm-up, halves {first:.2f}x and {second:.2f}x)\n"
    )
    shared = "opencl:0" if opencl else None
    said = depends(
        cores=_cores(), blas_limited=blas_limited, load=load_before, shared_device=shared
    )
    out.write(f"  {said}\n")
    line = verdict(
        t_pipe=timed.t_pipe,
        t_seq=timed.t_seq,
        cores=_cores(),
        load=load_before,
        blas_limited=blas_limited,
        processes=args.processes,
        shared_device=shared,
    )
    out.write(f"  {line}\n")
    if trace_path is None:
        out.write("  trace: not written (--no-trace)\n")
    else:
        note = (
            " (the stages ran in worker processes, which this trace does not see; it holds "
            "the 1-device run and this process's tasks)"
            if args.processes
            else ""
        )
        out.write(
            f"  trace: {trace_path}{note}; read it with hcqa trace summary {trace_path}, "
            "hcqa trace plot, or ui.perfetto.dev\n"
        )
    return 0 if ok else 1
