"""``hcqa demo``: an MLP split over two cpu devices as a two-stage Pipeline (or a real model).

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

``--model squeezenet`` runs a real model instead (:mod:`hcqa.cli._model_demo`): the onnx wheel's
SqueezeNet with seeded weights, cut over the two devices by ``models.pipeline`` and checked
against onnxruntime. The verdict, the host facts and the kept trace are :mod:`hcqa.cli._report`'s,
shared by both.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

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
from hcqa.cli._model_demo import MODELS
from hcqa.cli._report import (
    MIN_SECONDS,
    WARM_SECONDS,
    check_opencl,
    depends,
    host_load,
    kept_trace,
    one_blas_thread,
    partial_trace,
    report_times,
    trace_line,
    trace_path_of,
    verdict,
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
    add(
        "--model",
        choices=MODELS,
        help="run a real model instead of the MLP: squeezenet (the onnx wheel's SqueezeNet, "
        "seeded weights) or gpt (a GPT-like decoder stack), cut over two devices by "
        "models.pipeline and checked against onnxruntime "
        f"({install_hint('models')})",
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


def run(args: argparse.Namespace) -> int:
    from hcqa.cli._console import progress

    if args.model is not None:
        from hcqa.cli._model_demo import run_model

        return run_model(args)
    spec = _spec(args)
    opencl = args.device == "opencl"
    if opencl:
        check_opencl()
    out = sys.stdout
    mib = 4 * spec.layers * (spec.hidden + 1) * spec.hidden / 2**20
    out.write(
        f"hcqa demo: {spec.layers}-layer MLP, hidden {spec.hidden}, float32, "
        f"{spec.batches} microbatches of {spec.batch_size} rows\n"
    )
    trace_path = trace_path_of(args)
    partial = partial_trace(trace_path) if trace_path else None
    instruments: list[trio.abc.Instrument] = [hcqa.Tracer(partial)] if partial else []
    weights, xs = make_weights(spec), make_inputs(spec)
    load_before = host_load()  # the host's load before the demo adds its own
    warm = min(spec.batches, 2 * args.depth)  # fills the pipeline, touches every slot
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="hcqa-"))
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "mlp-weights.bin")
        layout = save_weights(weights, path)
        out.write(f"  weights: {mib:.1f} MiB written to {path}, loaded with Buffer.load\n")
        out.flush()
        blas, blas_limited = one_blas_thread()
        steps = 2 * (warm + spec.batches)
        with blas(), progress("starting", steps, enabled=not args.no_progress) as bar:
            body = run_processes if args.processes else run_threads
            warm_seconds = 0.0 if args.quick else WARM_SECONDS
            if opencl:
                from hcqa.cli._mlp_opencl import run_opencl

                body = run_opencl
            with kept_trace(partial, trace_path):
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
    report_times(
        out,
        timed,
        spec.batches,
        blas_limited=blas_limited,
        load=load_before,
        processes=args.processes,
        shared_device="opencl:0" if opencl else None,
    )
    note = (
        " (the stages ran in worker processes, which this trace does not see; it holds "
        "the 1-device run and this process's tasks)"
        if args.processes
        else ""
    )
    out.write(trace_line(trace_path, note))
    return 0 if ok else 1
