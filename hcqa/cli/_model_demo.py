"""``hcqa demo --model squeezenet|gpt``: a real model cut over two devices, checked against
onnxruntime.

Theory of operation
-------------------
The model is made in code, nothing downloaded (:mod:`hcqa.cli._zoo`): the onnx wheel's SqueezeNet
with seeded weights, a fixed batch of ``--batch-size`` pictures of ``side x side`` (64 by
default: SqueezeNet's pools need 40 or more), or a GPT-like decoder stack written as an ONNX
graph (2 pre-norm layers of causal attention and a ReLU MLP, width 128, 32 tokens). It is
written to the work folder and loaded with :func:`hcqa.models.load_onnx` on tinygrad's kernels:
every kernel tinygrad generates becomes an hcqa program and one captured Graph replays them (the
front end's capture runs in a worker thread; a second run reuses hcqa's model cache, so it
starts in seconds). ``models.pipeline`` cuts it over the two devices.

Two sides run the same microbatches, as in the MLP demo: the model cut over two devices
(``cpu:0`` / ``cpu:1``, or two hcqa devices on ``opencl:0`` with ``--device opencl``) and the
whole model on the first device, ``depth`` microbatches in flight on each. Both are warmed up,
then timed A B B A (:mod:`hcqa.cli._mlp`'s ``_timed``), and the output gives the throughput of
each, the speedup and the verdict (:mod:`hcqa.cli._report`).

Every answer of both sides is checked against onnxruntime's session of the same file (one
thread, on the host, after the timed run): the output prints the largest absolute error and the
tolerance, ``|hcqa - onnxruntime| <= atol + rtol * |onnxruntime|`` (:data:`TOLERANCE`, per
model); a mismatch exits 1.

The trace is the MLP demo's machinery (``--trace``, ``--no-trace``, kept only when the run
finished): regions for the set-up, the warm-ups and each timed part, and a range per kernel on
each device's compute track. While the model builds (seconds on a CPU, up to a minute on PoCL)
the progress bar (on a terminal) names the phase and the time spent.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import trio

import hcqa
from hcqa.cli._mlp import F32, Timed, _timed
from hcqa.cli._report import (
    WARM_SECONDS,
    check_opencl,
    host_load,
    kept_trace,
    partial_trace,
    report_times,
    trace_line,
    trace_path_of,
)
from hcqa.errors import install_hint
from hcqa.trace import region

if TYPE_CHECKING:
    from hcqa.cli._console import Bar

__all__ = ["FULL", "MODELS", "QUICK", "TOLERANCE", "ModelSpec", "check", "run_model"]

MODELS = ("squeezenet", "gpt")
# (rtol, atol) against onnxruntime: SqueezeNet's answers are softmax probabilities (about 1e-3
# each); the GPT stack's are LayerNorm outputs of order 1, summed over 4 x 128-wide matmuls
TOLERANCE = {"squeezenet": (1e-4, 1e-6), "gpt": (1e-4, 1e-5)}
DESCRIBED = {
    "squeezenet": "SqueezeNet (the onnx wheel's architecture, seeded weights)",
    "gpt": "a GPT-like decoder stack (2 layers, width 128, 4 heads, causal; seeded weights)",
}


@dataclass(frozen=True)
class ModelSpec:
    """The work: ``batches`` microbatches of ``rows`` pictures of ``side x side`` (SqueezeNet)
    or ``rows`` sequences of ``side`` tokens, each ``width`` wide (the GPT stack)."""

    model: str
    batches: int
    rows: int
    side: int
    seed: int = 0
    width: int = 128

    @property
    def shape(self) -> tuple[int, ...]:
        if self.model == "gpt":
            return (self.rows, self.side, self.width)
        return (self.rows, 3, self.side, self.side)


FULL = {
    "squeezenet": ModelSpec("squeezenet", batches=64, rows=4, side=64),
    "gpt": ModelSpec("gpt", batches=192, rows=4, side=32),
}
QUICK = {
    "squeezenet": ModelSpec("squeezenet", batches=6, rows=1, side=40),
    "gpt": ModelSpec("gpt", batches=6, rows=1, side=16),
}


def _spec(args: argparse.Namespace) -> ModelSpec:
    from hcqa.cli._base import CliError

    for flag, used in (("--hidden", args.hidden is not None), ("--processes", args.processes)):
        if used:
            raise CliError(f"{flag} is the MLP demo's: not with --model")
    base = (QUICK if args.quick else FULL)[args.model]
    spec = ModelSpec(
        args.model,
        batches=args.batches if args.batches is not None else base.batches,
        rows=args.batch_size if args.batch_size is not None else base.rows,
        side=base.side,
    )
    for name, value in (
        ("--batches", spec.batches),
        ("--batch-size", spec.rows),
        ("--depth", args.depth),
    ):
        if value < 1:
            raise CliError(f"{name} must be >= 1 (got {value})")
    missing = [
        m for m in ("onnx", "onnxruntime", "tinygrad") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise CliError(
            f"--model needs {', '.join(missing)} (the models extra: {install_hint('models')})"
        )
    return spec


def _inputs(spec: ModelSpec) -> list[F32]:
    rng = np.random.default_rng(spec.seed + 1)
    shape = spec.shape
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(spec.batches)]


def _reference(path: Path, xs: Sequence[F32]) -> list[F32]:
    """onnxruntime's answers (one thread, its warnings off), on the host."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return [sess.run(None, {name: x})[0] for x in xs]


def check(got: Sequence[F32], want: Sequence[F32], rtol: float, atol: float) -> tuple[float, bool]:
    """(largest absolute error, whether every answer is within ``atol + rtol * |want|``)."""
    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
    ok = len(got) == len(want) and all(
        g.shape == w.shape and np.allclose(g, w, rtol=rtol, atol=atol)
        for g, w in zip(got, want, strict=True)
    )
    return worst, ok


async def _body(
    spec: ModelSpec,
    path: Path,
    depth: int,
    xs: Sequence[F32],
    bar: Bar,
    warm: int,
    warm_seconds: float,
    specs: tuple[str, str],
    notes: list[str],
) -> Timed:
    from hcqa import models

    async with hcqa.open_devices(*specs) as (d0, d1):
        with region("set-up: model built and cut"):
            bar.describe(f"building {spec.model} on {d0.name} (tinygrad's kernels)")
            t0 = time.perf_counter()
            model = await models.load_onnx(path, device=d0, name=spec.model)
            st = model.statistics()
            notes.append(
                f"  model: built on {d0.name} in {time.perf_counter() - t0:.1f} s: "
                f"{st.kernels} kernels ({st.programs} programs) in one Graph"
            )
            bar.describe(f"cutting {spec.model} over {d0.name} and {d1.name}")
            t0 = time.perf_counter()
            pipe = models.pipeline(model, devices=[d0, d1], depth=depth)
            seq = models.pipeline(model, devices=[d0], depth=depth)
            await pipe.build()
            await seq.build()
            cuts = ", ".join(
                f"{s.device.name} kernels {s.start + 1}-{s.stop} (cost {s.cost:.3g}, "
                f"{s.moved_bytes} bytes moved in)"
                for s in pipe.stages
            )
            notes.append(
                f"  pipeline: models.pipeline built in {time.perf_counter() - t0:.1f} s: {cuts}; "
                f"{depth} microbatches in flight; the 1-device side is models.pipeline "
                f"over {d0.name} alone"
            )
        runs = await _timed(pipe, seq, xs, bar, warm, warm_seconds, ("pipeline", "1 device"))
        names = (d0.name, d1.name)
    return Timed.of(
        runs,
        pipe_label=f"pipeline, 2 devices ({names[0]}, {names[1]})",
        seq_label=f"sequential, 1 device ({names[0]})",
        pipe_desc=f"{spec.model} over {names[0]} and {names[1]}",
    )


def run_model(args: argparse.Namespace) -> int:
    """``hcqa demo --model NAME``: see the module doc."""
    from hcqa.cli._console import progress
    from hcqa.cli._zoo import gpt_block, with_weights

    spec = _spec(args)
    opencl = args.device == "opencl"
    if opencl:
        check_opencl()
    out = sys.stdout
    out.write(
        f"hcqa demo: {DESCRIBED[spec.model]}, {spec.batches} microbatches of "
        f"{'x'.join(map(str, spec.shape))} float32\n"
    )
    trace_path = trace_path_of(args)
    partial = partial_trace(trace_path) if trace_path else None
    instruments: list[trio.abc.Instrument] = [hcqa.Tracer(partial)] if partial else []
    xs = _inputs(spec)
    load_before = host_load()
    warm = min(spec.batches, 2 * args.depth)
    specs = ("opencl:0", "opencl:0") if opencl else ("cpu:0", "cpu:1")
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="hcqa-"))
        os.makedirs(workdir, exist_ok=True)
        if spec.model == "gpt":
            path = gpt_block(Path(workdir), rows=spec.rows, seq=spec.side, seed=spec.seed)
        else:
            path = with_weights(
                spec.model, Path(workdir), seed=spec.seed, rows=spec.rows, side=spec.side
            )
        out.write(f"  model file: {path}\n")
        out.flush()
        steps = 2 * (warm + spec.batches)
        warm_seconds = 0.0 if args.quick else WARM_SECONDS
        body = functools.partial(
            _body,
            spec,
            path,
            args.depth,
            xs,
            warm=warm,
            warm_seconds=warm_seconds,
            specs=specs,
            notes=notes,
        )
        with progress("starting", steps, enabled=not args.no_progress) as bar:
            with kept_trace(partial, trace_path):
                timed = trio.run(functools.partial(body, bar=bar), instruments=instruments)
        want = _reference(path, xs)
    for line in notes:
        out.write(line + "\n")
    rtol, atol = TOLERANCE[spec.model]
    worst, ok = check([*timed.got, *timed.want], [*want, *want], rtol, atol)
    out.write(
        f"  check: all {spec.batches} answers of each side vs onnxruntime, max abs error "
        f"{worst:.3g} (tolerance {atol:g} + {rtol:g} x |onnxruntime's|): "
        f"{'ok' if ok else 'WRONG'}\n"
    )
    report_times(
        out,
        timed,
        spec.batches,
        blas_limited=None,  # tinygrad's own kernels: no BLAS
        load=load_before,
        shared_device="opencl:0" if opencl else None,
    )
    out.write(trace_line(trace_path))
    return 0 if ok else 1
