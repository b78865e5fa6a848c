"""The demo's model and drivers: an MLP as a two-stage pipeline, timed against one device.

Theory of operation: see :mod:`hcqa.cli.demo`, the command built on these pieces (which also
re-exports them, for ``bench.bench_pipeline`` and for worker processes, which load the stage
factory as ``"hcqa.cli.demo:mlp_stage"``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
import trio

import hcqa
from hcqa.trace import region

if TYPE_CHECKING:
    from hcqa.cli._console import Bar

__all__ = [
    "F32",
    "FULL",
    "QUICK",
    "WARM_PASSES",
    "Driven",
    "Layout",
    "MlpSpec",
    "Timed",
    "build_pipelines",
    "drive",
    "load_params",
    "make_inputs",
    "make_weights",
    "mlp_kernel",
    "mlp_stage",
    "run_processes",
    "run_threads",
    "save_weights",
]

F32 = npt.NDArray[np.float32]
Layout = list[tuple[int, int]]  # (offset, nbytes) in the weights file, per array: W0, b0, W1, ...


class Driven(Protocol):
    """What :func:`drive` runs: a pipeline (``hcqa.Pipeline``, a process pipeline, a model's)
    awaited per microbatch, with ``depth`` of them in flight."""

    @property
    def depth(self) -> int: ...

    async def __call__(self, x: Any, /) -> Any: ...


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
STAGE = "hcqa.cli.demo:mlp_stage"  # the process stages' factory, as worker processes import it


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
    pipe: Driven,
    xs: Sequence[F32],
    on_result: Callable[[], None] | None = None,
    *,
    label: str = "drive",
) -> tuple[list[F32], float]:
    """Run every ``x`` through ``pipe`` with ``depth`` in flight; (outputs, wall seconds).

    The worker tasks are named ``"{label} worker k"``, so a trace shows which run they served."""
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
            for k in range(min(pipe.depth, len(xs))):
                nursery.start_soon(worker, name=f"{label} worker {k + 1}")
    except BaseExceptionGroup as group:  # the workers fail alike: raise one, unwrapped
        raise _first_leaf(group) from None
    return results, time.perf_counter() - start


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


@dataclass(frozen=True)
class Timed:
    """What a demo run measured: both sides' outputs and seconds, and what each side was."""

    got: list[F32]  # the pipeline's outputs
    want: list[F32]  # the 1-device run's outputs
    t_pipe: float
    t_seq: float
    halves: tuple[float, float]  # the speedup of the first half's pair and of the second's
    pipe_label: str  # "pipeline, 2 devices" / "pipeline, 2 worker processes"
    seq_label: str
    pipe_desc: str

    @classmethod
    def of(
        cls,
        runs: tuple[list[F32], list[F32], list[float], list[float]],
        *,
        pipe_label: str,
        seq_label: str,
        pipe_desc: str,
    ) -> Timed:
        """From what ``_timed`` returns: the totals, and each half's speedup."""
        got, want, t_pipe, t_seq = runs
        first, second = (
            s / p if p > 0 else float("inf") for p, s in zip(t_pipe, t_seq, strict=True)
        )
        return cls(
            got=got,
            want=want,
            t_pipe=sum(t_pipe),
            t_seq=sum(t_seq),
            halves=(first, second),
            pipe_label=pipe_label,
            seq_label=seq_label,
            pipe_desc=pipe_desc,
        )


WARM_PASSES = 8  # at most, per side


async def _timed(
    pipe: Driven,
    seq: Driven,
    xs: Sequence[F32],
    bar: Bar,
    warm: int,
    warm_seconds: float = 0.0,
    names: tuple[str, str] = ("pipeline", "1 device"),
) -> tuple[list[F32], list[F32], list[float], list[float]]:
    """Warm both sides up, then time them A B B A; (pipe outs, seq outs, pipe s, seq s), the
    seconds per half (the first half's pair, then the second's).

    The warm-up runs ``warm`` microbatches through each side, again and again until that side
    has run for ``warm_seconds`` (at most ``WARM_PASSES`` passes): a first run in a fresh
    process pays for first touches of pages and BLAS buffers, and the host's cores ramp up,
    which would otherwise land in the timed run of whichever side goes first.

    Each part is a region of the trace (``hcqa.trace.region``) named after its side
    (``names``: the pipeline's, the one device's), so a plot says which is which."""
    bar.describe("warming up")
    shown = {"pipeline": names[0], "sequential": names[1]}
    for name, p in (("pipeline", pipe), ("sequential", seq)):
        spent = 0.0
        with region(f"warm-up: {shown[name]}"):
            for k in range(WARM_PASSES):
                _, t = await drive(
                    p, xs[:warm], bar.advance if k == 0 else None, label=f"warm-up {name}"
                )
                spent += t
                if spent >= warm_seconds:
                    break
    # A B B A: each side runs half the batches early and half late, so a drift in the host's
    # load (shared machines vary a lot) hits both alike.
    cut = len(xs) // 2
    sides = {"pipeline": pipe, "sequential": seq}
    outs: dict[str, list[F32]] = {"pipeline": [], "sequential": []}
    secs: dict[str, list[float]] = {"pipeline": [], "sequential": []}
    for name, lo, hi in (
        ("pipeline", 0, cut),
        ("sequential", 0, cut),
        ("sequential", cut, len(xs)),
        ("pipeline", cut, len(xs)),
    ):
        bar.describe(f"{name} {lo + 1}-{hi}")
        with region(f"{shown[name]} {lo + 1}-{hi}", microbatches=[lo + 1, hi]):
            got, t = await drive(sides[name], xs[lo:hi], bar.advance, label=f"{name} {lo + 1}-{hi}")
        outs[name] += got
        secs[name].append(t)
    return outs["pipeline"], outs["sequential"], secs["pipeline"], secs["sequential"]


async def run_threads(
    spec: MlpSpec,
    path: str,
    layout: Layout,
    depth: int,
    xs: Sequence[F32],
    bar: Bar,
    warm: int,
    warm_seconds: float = 0.0,
) -> Timed:
    """The two stages on cpu:0 and cpu:1 against every layer on cpu:0, in this process."""
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        pipe, seq = await build_pipelines(d0, d1, spec, path, layout, depth)
        names = ("pipeline", "1 device")
        runs = await _timed(pipe, seq, xs, bar, warm, warm_seconds, names)
    return Timed.of(
        runs,
        pipe_label="pipeline, 2 devices",
        seq_label="sequential, 1 device",
        pipe_desc=repr(pipe),
    )


async def run_processes(
    spec: MlpSpec,
    path: str,
    layout: Layout,
    depth: int,
    xs: Sequence[F32],
    bar: Bar,
    warm: int,
    warm_seconds: float = 0.0,
) -> Timed:
    """The same two stages, each in its own worker process (``hcqa.processes``), against every
    layer on one device (cpu:0) of this process -- run on its engine thread, so the baseline
    never blocks the event loop, and it shows in the trace."""
    from hcqa.processes import ProcessStage, open_process_pipeline

    half = spec.layers // 2
    b, h = spec.batch_size, spec.hidden
    common = {"path": path, "layout": [list(x) for x in layout], "batch": b, "hidden": h}
    stages = [
        ProcessStage(fn=STAGE, args={**common, "first": 0, "last": half}),
        ProcessStage(fn=STAGE, args={**common, "first": half, "last": spec.layers}),
    ]
    async with hcqa.open_device("cpu:0") as d0:
        params = await load_params(d0, path, layout, range(spec.layers), h)
        whole = hcqa.Stage(
            device=d0, program=mlp_kernel(spec.layers, b, h), params=params, name="mlp"
        )
        seq = hcqa.Pipeline([whole], in_shape=(b, h), depth=depth)
        async with open_process_pipeline(stages, in_shape=(b, h), depth=depth) as pipe:
            names = ("pipeline (processes)", "1 device")
            runs = await _timed(pipe, seq, xs, bar, warm, warm_seconds, names)
            pids = ", ".join(str(w.pid) for w in pipe.workers)
    return Timed.of(
        runs,
        pipe_label="pipeline, 2 worker processes",
        seq_label="sequential, 1 device (cpu:0)",
        pipe_desc=f"2 worker processes (pids {pids})",
    )
