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

BLAS is held to one thread (``threadpoolctl.threadpool_limits(1)``) for the whole run, so the
devices -- each with its own engine thread -- are the unit of parallelism, and two stages on
two devices can approach 2x the sequential throughput on two cores.

``drive`` keeps ``depth`` worker tasks pulling microbatch indices, so exactly ``depth``
microbatches are in flight and every completion ticks the progress bar (stderr, ``\\r``,
only on a tty). The two pipelines are timed A B B A (each runs half the batches early and half
late), so a drift in the host's load -- shared machines vary a lot -- hits both alike.

Every output of the pipeline is compared with the sequential run's, and a sample with a numpy
reference computed on the host by the same kernel code; the largest absolute error against
numpy is reported and a mismatch exits with status 1.

The whole run is one ``trio.run``; :class:`hcqa.Tracer` is
installed as an instrument and writes a Chrome trace (``--trace``, else ``$HCQA_TRACE``, else
``hcqa-demo-trace.json``; read it with ``hcqa trace summary`` or https://ui.perfetto.dev).
:mod:`bench.bench_pipeline` reuses the building blocks here for its timed comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt
import trio

import hcqa

__all__ = [
    "FULL",
    "QUICK",
    "MlpSpec",
    "Progress",
    "build_pipelines",
    "configure",
    "drive",
    "load_params",
    "make_inputs",
    "make_weights",
    "mlp_kernel",
    "run",
    "save_weights",
]

F32 = npt.NDArray[np.float32]
Layout = list[tuple[int, int]]  # (offset, nbytes) in the weights file, per array: W0, b0, W1, ...


@dataclass(frozen=True)
class MlpSpec:
    """The work: ``batches`` microbatches of ``batch_size x hidden`` through ``layers`` layers."""

    batches: int
    batch_size: int
    hidden: int
    layers: int = 4
    seed: int = 0


FULL = MlpSpec(batches=128, batch_size=256, hidden=1024)  # about 5-10 s on 2 cores
QUICK = MlpSpec(batches=8, batch_size=32, hidden=128)


def make_weights(spec: MlpSpec) -> list[F32]:
    """``[W0, b0, W1, b1, ...]``, He-scaled so activations stay O(1) through the layers."""
    rng = np.random.default_rng(spec.seed)
    h = spec.hidden
    out: list[F32] = []
    for _ in range(spec.layers):
        out.append((rng.standard_normal((h, h)) * np.sqrt(2.0 / h)).astype(np.float32))
        out.append((rng.standard_normal(h) * 0.01).astype(np.float32))
    return out


def make_inputs(spec: MlpSpec) -> list[F32]:
    rng = np.random.default_rng(spec.seed + 1)
    shape = (spec.batch_size, spec.hidden)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(spec.batches)]


def save_weights(weights: Sequence[F32], path: str | os.PathLike[str]) -> Layout:
    """Write the arrays back to back; their ``(offset, nbytes)`` in the file."""
    layout: Layout = []
    offset = 0
    with open(path, "wb") as f:
        for w in weights:
            f.write(np.ascontiguousarray(w).tobytes())
            layout.append((offset, w.nbytes))
            offset += w.nbytes
    return layout


def mlp_kernel(n_layers: int, batch: int, hidden: int) -> Callable[..., None]:
    """``kernel(out, x, W0, b0, ...)``: ``n_layers`` of ``relu(x @ W + b)``, nothing allocated.

    The scratch arrays belong to the kernel: a device's compute engine runs one kernel at a
    time, so a kernel made for one stage is never entered twice at once."""
    scratch = [np.empty((batch, hidden), np.float32) for _ in range(min(2, n_layers - 1))]

    def kernel(out: F32, x: F32, *params: F32) -> None:
        src = x
        for i in range(n_layers):
            dst = out if i == n_layers - 1 else scratch[i % 2]
            np.matmul(src, params[2 * i], out=dst)
            np.add(dst, params[2 * i + 1], out=dst)
            np.maximum(dst, 0.0, out=dst)
            src = dst

    return kernel


def mlp_stage(
    path: str, layout: list[list[int]], first: int, last: int, batch: int, hidden: int
) -> Callable[..., None]:
    """Stage factory for worker processes: layers ``first..last-1`` with their weights
    read from ``path`` (the worker's own copy), as ``fn(out, inp)``."""
    params: list[F32] = []
    for layer in range(first, last):
        for k, count in ((2 * layer, hidden * hidden), (2 * layer + 1, hidden)):
            offset, _ = layout[k]
            arr = np.fromfile(path, dtype=np.float32, count=count, offset=offset)
            params.append(arr.reshape((hidden, hidden)) if count == hidden * hidden else arr)
    kernel = mlp_kernel(last - first, batch, hidden)

    def stage(out: F32, inp: F32) -> None:
        kernel(out, inp, *params)

    return stage


async def drive_processes(
    spec: MlpSpec,
    path: str,
    layout: Layout,
    depth: int,
    xs: Sequence[F32],
    on_result: Callable[[], None] | None = None,
) -> tuple[list[F32], float, str]:
    """The same two stages, each in its own worker process (``hcqa.workers``)."""
    from hcqa.workers import ProcessStage, open_process_pipeline

    half = spec.layers // 2
    b, h = spec.batch_size, spec.hidden
    common = {"path": path, "layout": [list(x) for x in layout], "batch": b, "hidden": h}
    stages = [
        ProcessStage(fn="hcqa.demo:mlp_stage", args={**common, "first": 0, "last": half}),
        ProcessStage(fn="hcqa.demo:mlp_stage", args={**common, "first": half, "last": spec.layers}),
    ]
    async with open_process_pipeline(stages, in_shape=(b, h), depth=depth) as pipe:
        await pipe(xs[0])  # warm-up
        results, elapsed = await drive(pipe, xs, on_result)
        pids = ", ".join(str(w.pid) for w in pipe.workers)
    return results, elapsed, f"2 worker processes (pids {pids})"


async def load_params(
    device: hcqa.Device, path: str, layout: Layout, layers: range, hidden: int
) -> tuple[hcqa.Buffer, ...]:
    """Allocate the weights of ``layers`` on ``device`` and ``Buffer.load`` them from ``path``."""
    bufs: list[hcqa.Buffer] = []
    fences: list[hcqa.Fence] = []
    for layer in layers:
        for k, shape in ((2 * layer, (hidden, hidden)), (2 * layer + 1, (hidden,))):
            offset, nbytes = layout[k]
            buf = device.alloc(shape=shape, dtype="float32")
            fences.append(buf.load(path, offset=offset, nbytes=nbytes))
            bufs.append(buf)
    for fence in fences:
        await fence
    return tuple(bufs)


async def build_pipelines(
    d0: hcqa.Device, d1: hcqa.Device, spec: MlpSpec, path: str, layout: Layout, depth: int
) -> tuple[hcqa.Pipeline, hcqa.Pipeline]:
    """(two-stage pipeline over d0 -> d1, one-stage pipeline of every layer on d0)."""
    half = spec.layers // 2
    b, h = spec.batch_size, spec.hidden
    first = await load_params(d0, path, layout, range(half), h)
    second = await load_params(d1, path, layout, range(half, spec.layers), h)
    rest_on_d0 = await load_params(d0, path, layout, range(half, spec.layers), h)
    stages = [
        hcqa.Stage(device=d0, program=mlp_kernel(half, b, h), params=first, name="layers_a"),
        hcqa.Stage(
            device=d1, program=mlp_kernel(spec.layers - half, b, h), params=second, name="layers_b"
        ),
    ]
    whole = hcqa.Stage(
        device=d0, program=mlp_kernel(spec.layers, b, h), params=first + rest_on_d0, name="mlp"
    )
    shape = (b, h)
    return (
        hcqa.Pipeline(stages, in_shape=shape, depth=depth),
        hcqa.Pipeline([whole], in_shape=shape, depth=depth),
    )


async def drive(
    pipe: hcqa.Pipeline | hcqa.ProcessPipeline,
    xs: Sequence[F32],
    on_result: Callable[[], None] | None = None,
) -> tuple[list[F32], float]:
    """Run every ``x`` through ``pipe`` with ``depth`` in flight; (outputs, wall seconds)."""
    results: list[Any] = [None] * len(xs)
    indices: Iterator[int] = iter(range(len(xs)))

    async def worker() -> None:
        for i in indices:
            results[i] = await pipe(xs[i])
            if on_result is not None:
                on_result()

    start = time.perf_counter()
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(min(pipe.depth, len(xs))):
                nursery.start_soon(worker)
    except BaseExceptionGroup as group:  # the workers fail alike: raise one, unwrapped
        raise _first_leaf(group) from None
    return results, time.perf_counter() - start


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class Progress:
    """A one-line progress bar on a tty (``\\r`` redraws); silent when disabled."""

    def __init__(self, stream: TextIO, enabled: bool, width: int = 30) -> None:
        self.stream, self.enabled, self.width = stream, enabled, width
        self.label, self.total, self.done, self.start = "", 0, 0, 0.0

    def begin(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.start = label, total, 0, time.perf_counter()

    def relabel(self, label: str) -> None:
        self.label = label
        self._draw()

    def advance(self) -> None:
        self.done += 1
        self._draw()

    def end(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (self.width + len(self.label) + 30) + "\r")
            self.stream.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        secs = time.perf_counter() - self.start
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {secs:5.1f} s")
        self.stream.flush()


def _tracer(path: str) -> tuple[list[trio.abc.Instrument], str]:
    """([the Tracer instrument], how the trace is reported)."""
    return [hcqa.Tracer(path)], f"trace: {path} (hcqa trace summary {path}; or ui.perfetto.dev)"


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
        "--processes",
        action="store_true",
        help="run each stage in its own worker process (shared memory + signals)",
    )
    add("--no-progress", action="store_true", help="no progress bar (off anyway if not a tty)")
    add("--workdir", help="where to write the weights file (default: a temporary directory)")
    add(
        "--trace",
        help="Chrome trace file to write (default: $HCQA_TRACE, else hcqa-demo-trace.json)",
    )


def _spec(args: argparse.Namespace) -> MlpSpec:
    from hcqa.cli import CliError

    base = QUICK if args.quick else FULL
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
    return spec


def _one_blas_thread() -> tuple[contextlib.AbstractContextManager[object], str]:
    """(a context holding BLAS to one thread, how the pipeline line says so).

    threadpoolctl is the optional extra ``hcqa[demo]``; without it BLAS keeps its own pool,
    which competes with the devices for the cores, and the demo says so."""
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
    except ImportError:
        note = "BLAS threads NOT limited (pip install 'hcqa[demo]' adds threadpoolctl)"
        return contextlib.nullcontext(), note
    return threadpool_limits(1), "BLAS limited to 1 thread per device"


def run(args: argparse.Namespace) -> int:
    spec = _spec(args)
    out = sys.stdout
    bar = Progress(sys.stderr, enabled=not args.no_progress and sys.stderr.isatty())
    mib = 4 * spec.layers * (spec.hidden + 1) * spec.hidden / 2**20
    out.write(
        f"hcqa demo: {spec.layers}-layer MLP, hidden {spec.hidden}, float32, "
        f"{spec.batches} microbatches of {spec.batch_size} rows\n"
    )
    weights, xs = make_weights(spec), make_inputs(spec)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="hcqa-"))
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "mlp-weights.bin")
        layout = save_weights(weights, path)
        out.write(f"  weights: {mib:.1f} MiB written to {path}, loaded with Buffer.load\n")
        instruments, trace_note = _tracer(
            args.trace or os.environ.get("HCQA_TRACE") or "hcqa-demo-trace.json"
        )

        async def main() -> tuple[list[F32], list[F32], float, float, str]:
            if args.processes:
                return await main_processes()
            async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
                pipe, seq = await build_pipelines(d0, d1, spec, path, layout, args.depth)
                for p in (pipe, seq):  # warm-up: first calls touch fresh memory
                    await p(xs[0])
                # A B B A: each side runs half the batches early and half late, so a drift
                # in the host's load hits both alike.
                cut = spec.batches // 2
                pipes = {"pipeline": pipe, "sequential": seq}
                outs: dict[str, list[F32]] = {"pipeline": [], "sequential": []}
                secs = {"pipeline": 0.0, "sequential": 0.0}
                bar.begin("", 2 * spec.batches)
                try:
                    for name, lo, hi in (
                        ("pipeline", 0, cut),
                        ("sequential", 0, cut),
                        ("sequential", cut, spec.batches),
                        ("pipeline", cut, spec.batches),
                    ):
                        bar.relabel(f"{name} {lo + 1}-{hi}".ljust(20))
                        got, t = await drive(pipes[name], xs[lo:hi], bar.advance)
                        outs[name] += got
                        secs[name] += t
                finally:
                    bar.end()
                return (
                    outs["pipeline"],
                    outs["sequential"],
                    secs["pipeline"],
                    secs["sequential"],
                    repr(pipe),
                )

        async def main_processes() -> tuple[list[F32], list[F32], float, float, str]:
            bar.begin("processes".ljust(20), spec.batches)
            try:
                got, t_pipe, desc = await drive_processes(
                    spec, path, layout, args.depth, xs, bar.advance
                )
            finally:
                bar.end()
            kernel = mlp_kernel(spec.layers, spec.batch_size, spec.hidden)
            want = []
            start = time.perf_counter()
            for x in xs:  # sequential: one process, every layer (numpy, 1 BLAS thread)
                ref = np.empty_like(x)
                kernel(ref, x, *weights)
                want.append(ref)
            return got, want, t_pipe, time.perf_counter() - start, desc

        blas, blas_note = _one_blas_thread()
        with blas:
            got, want, t_pipe, t_seq, desc = trio.run(main, instruments=instruments)
            half = spec.layers // 2
            where = ("worker 1", "worker 2") if args.processes else ("cpu:0", "cpu:1")
            out.write(
                f"  pipeline: {desc}: {where[0]} runs layers 1-{half}, {where[1]} layers "
                f"{half + 1}-{spec.layers}; {blas_note}\n"
            )
            sample = sorted({*range(0, spec.batches, max(1, spec.batches // 8)), spec.batches - 1})
            kernel = mlp_kernel(spec.layers, spec.batch_size, spec.hidden)
            errors: list[float] = []
            for i in sample:
                ref = np.empty_like(xs[i])
                kernel(ref, xs[i], *weights)
                errors.append(float(np.max(np.abs(got[i] - ref))))
        worst = max(errors)
        scale = max(1.0, max(float(np.max(np.abs(g))) for g in got))
        ok = worst <= 1e-4 * scale and all(
            np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want, strict=True)
        )
        verdict = "ok" if ok else "WRONG"
        out.write(
            f"  check: {len(sample)} outputs vs numpy, max abs error {worst:.3g}; all "
            f"{spec.batches} vs the 1-device run: {verdict}\n"
        )
        for name, secs in (("pipeline, 2 devices ", t_pipe), ("sequential, 1 device", t_seq)):
            out.write(f"  {name}: {secs:7.3f} s  {spec.batches / secs:8.1f} microbatches/s\n")
        out.write(f"  speedup: {t_seq / t_pipe:.2f}x (sequential time / pipeline time)\n")
        out.write(f"  {trace_note}\n")
    return 0 if ok else 1
