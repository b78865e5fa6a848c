"""``hcqa serve``: ONNX models, or the demo MLP, over HTTP (see docs/serving.md).

Arguments are parsed into checked values (a port, seconds, integers with a minimum, a model
as ``NAME=PATH.onnx`` or ``NAME:WIDTH``) so a bad one is a one-line usage error before any
device opens. An ONNX model is a :class:`hcqa.serve.Model` whose ``build`` opens its own
device (``--device``) and loads the file (:func:`hcqa.models.load_onnx`, ``--backend``) in
the background while the health endpoints answer, each model's steps shown as they happen
(a live status on a terminal, plain lines elsewhere: ``_startup.py``); a model that fails to
load ends the command with one line naming it. Demo MLPs share ``cpu:0`` and ``cpu:1`` (or
two devices on ``opencl:0``). The command runs :func:`hcqa.serve.serve` with SIGINT and
SIGTERM wired to a drain; a second signal stops at once (exit status 130): it cancels the
scope around the devices, so they close by cancellation -- what is queued on them is
dropped, not run. Once the models are ready the process's garbage collector is set for
serving (:func:`_settle_gc`)."""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

from hcqa.cli._base import PROG, CliError, _out, run_trio
from hcqa.cli._startup import startup
from hcqa.errors import install_hint

__all__ = ["configure_serve", "run_serve"]


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535 (got {value})")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} (got {value})")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds (got {text!r})") from None
    if not 0 <= value < float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got {text})")
    return value


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # as hcqa.serve.v2.NAME_PATTERN


def _model(text: str) -> tuple[str, str | int]:
    """``NAME=PATH`` (an ONNX file) or ``NAME:WIDTH`` (the demo MLP)."""
    name, sep, path = text.partition("=")
    if sep:
        if not _NAME.fullmatch(name) or not path:
            raise argparse.ArgumentTypeError(
                f"must be NAME=PATH.onnx or NAME:WIDTH, NAME 1-64 letters, digits, '_', '.' "
                f"or '-' (got {text!r})"
            )
        return name, path
    name, sep, width = text.rpartition(":")
    if not sep or not _NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"must be NAME=PATH.onnx or NAME:WIDTH, NAME 1-64 letters, digits, '_', '.' or '-' "
            f"(got {text!r})"
        )
    return name, _int_at_least(1)(width)


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (got {text})")
    return value


def configure_serve(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=_port, default=8000, help="port, 0 for any free one (default: %(default)s)")
    add(
        "--max-batch",
        type=_int_at_least(1),
        default=32,
        help="most single samples per batch, also the MLP's batch dimension; 1 turns dynamic "
        "batching off (default: %(default)s)",
    )
    add(
        "--max-wait",
        type=_seconds,
        default=0.002,
        help="seconds a sample waits for its batch to fill while the devices are busy "
        "(default: %(default)s)",
    )
    add(
        "--max-pending",
        type=_int_at_least(1),
        default=256,
        help="/infer requests admitted at once; more get 503 (default: %(default)s)",
    )
    add(
        "--grace-period",
        type=_seconds,
        default=10.0,
        help="on SIGTERM or SIGINT, seconds to finish requests in flight (default: %(default)s)",
    )
    add(
        "--body-timeout",
        type=_positive_seconds,
        default=30.0,
        help="seconds a request's body may take to arrive; slower ones get 408 "
        "(default: %(default)s)",
    )
    add(
        "--access-log",
        default="-",
        metavar="FILE",
        help="one line per request to FILE, '-' for stdout, 'none' for no log "
        "(default: %(default)s)",
    )
    add(
        "--device",
        choices=("cpu", "opencl"),
        default="cpu",
        help="where models run: an ONNX model on cpu:0 or opencl:0; the MLP's layers on cpu:0 "
        "-> cpu:1 (numpy), or two devices on opencl:0 (OpenCL C kernels) (default: %(default)s)",
    )
    add(
        "--backend",
        choices=("tinygrad", "onnxruntime"),
        default=None,
        help="what runs an ONNX model's operators: tinygrad's kernels, captured as an hcqa graph, "
        "or onnxruntime's session as one kernel (cpu only) (default: onnxruntime on cpu, "
        "tinygrad on opencl)",
    )
    add(
        "--max-body",
        type=_int_at_least(1),
        default=None,
        metavar="BYTES",
        help="the largest request body; larger ones get 413 (default: 1 MiB, or 32 batches of "
        "the largest model's input if more)",
    )
    add(
        "--http",
        choices=("hcqa", "hypercorn"),
        default="hcqa",
        help="the HTTP server: hcqa's lean HTTP/1.1 one, or hypercorn (default: %(default)s)",
    )
    add(
        "--model",
        type=_model,
        action="append",
        metavar="NAME=PATH.onnx|NAME:WIDTH",
        help="serve the ONNX model at PATH, or a demo MLP of this width, under this name (repeat "
        "for several models, each with its own batcher; the first also answers /infer); "
        "default: mlp:WIDTH",
    )
    add(
        "--width",
        type=_int_at_least(1),
        default=256,
        help="MLP width of the default model 'mlp' (default: %(default)s)",
    )
    add(
        "--depth",
        type=_int_at_least(1),
        default=2,
        help="batches in flight on a model's devices at once: the MLP's pipeline depth, an ONNX "
        "model's slots (default: %(default)s)",
    )
    add(
        "--sleep-ms",
        type=_seconds,
        default=0.0,
        help="milliseconds each layer's kernel also sleeps, leaving the host idle as an "
        "accelerator does (default: %(default)s)",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Serve ONNX models or demo MLPs over HTTP; drain on a signal."""
    import importlib.util
    import signal

    needed = ("starlette", "prometheus_client") + (
        ("hypercorn",) if args.http == "hypercorn" else ()
    )
    for module in needed:
        if importlib.util.find_spec(module) is None:
            raise CliError(f"hcqa serve needs {module}: {install_hint('serve')}")
    import trio

    import hcqa
    from hcqa.errors import InvalidCommand, sole_error
    from hcqa.serve import Model, mlp_pipeline, serve
    from hcqa.serve.hosted import ModelFailed

    specs: list[tuple[str, str | int]] = args.model or [("mlp", args.width)]
    names = [name for name, _ in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CliError(f"--model names must differ (got {', '.join(twice)} twice)")
    if args.device == "opencl" and args.sleep_ms:
        raise CliError("--sleep-ms needs --device cpu (an OpenCL kernel can't sleep)")
    mlps = [(n, w) for n, w in specs if isinstance(w, int)]
    onnx = [(n, p) for n, p in specs if isinstance(p, str)]
    backend = args.backend or ("onnxruntime" if args.device == "cpu" else "tinygrad")
    if onnx:
        if backend == "onnxruntime" and args.device != "cpu":
            raise CliError("--backend onnxruntime needs --device cpu (its session runs on cpu:0)")
        for module in ("onnx", backend):
            if importlib.util.find_spec(module) is None:
                raise CliError(
                    f"hcqa serve --model NAME=PATH needs {module}: {install_hint('models')}"
                )
    sizes = tuple(sorted({2**k for k in range(args.max_batch.bit_length())} | {args.max_batch}))
    device_specs = ("cpu:0", "cpu:1") if args.device == "cpu" else ("opencl:0", "opencl:0")
    forced = False

    async def main() -> None:
        nonlocal forced
        stop = trio.Event()
        everything = trio.CancelScope()  # a second signal cancels it: the devices drop work
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals, everything:
            async with AsyncExitStack() as stack:
                devices: tuple[hcqa.Device, ...] = ()
                if mlps:
                    try:
                        devices = await stack.enter_async_context(hcqa.open_devices(*device_specs))
                    except InvalidCommand as exc:
                        raise CliError(f"hcqa serve --device {args.device}: {exc}") from None
                models = []
                status = stack.enter_context(startup([n for n, _ in onnx]))
                for name, what in specs:
                    told = functools.partial(status.event, name)
                    if isinstance(what, str):
                        told(f"loading {what} ({backend} on {device_specs[0]})")
                        build = _onnx_build(
                            what, backend, device_specs[0], sizes, name, args.depth, told
                        )
                        models.append(
                            Model(name=name, build=build, max_wait=args.max_wait, progress=told)
                        )
                        continue
                    pipes = await mlp_pipeline(
                        devices[0],
                        devices[1],
                        batch=args.max_batch,
                        width=what,
                        depth=args.depth,
                        sleep=args.sleep_ms / 1e3,
                        buckets=(1,),  # a lone sample runs unpadded in a batch-1 pipeline
                    )
                    models.append(
                        Model(
                            name=name,
                            pipeline=pipes,
                            max_batch=args.max_batch,
                            max_wait=args.max_wait,
                            warmup=True,
                        )
                    )
                async with trio.open_nursery() as nursery:

                    async def on_signals() -> None:
                        nonlocal forced
                        async for signum in signals:
                            name = signal.Signals(signum).name
                            if stop.is_set():
                                _out(f"{PROG}: {name} again: stopping now", sys.stderr)
                                forced = True
                                everything.cancel()
                                return
                            _out(
                                f"{PROG}: {name}: draining, up to {args.grace_period} s "
                                "for requests in flight",
                                sys.stderr,
                            )
                            stop.set()

                    async def server(task_status: trio.TaskStatus[int]) -> None:
                        try:
                            await serve(
                                models,
                                host=args.host,
                                port=args.port,
                                max_batch=args.max_batch,
                                max_wait=args.max_wait,
                                max_pending=args.max_pending,
                                grace_period=args.grace_period,
                                max_body=args.max_body,
                                body_timeout=args.body_timeout,
                                access_log=None if args.access_log == "none" else args.access_log,
                                shutdown_trigger=stop.wait,
                                http=args.http,
                                task_status=task_status,
                            )
                        except ModelFailed as exc:
                            raise CliError(str(exc)) from None
                        nursery.cancel_scope.cancel()  # drained: stop watching for signals

                    nursery.start_soon(on_signals)
                    port = await nursery.start(server)
                    _settle_gc()
                    batching = (
                        f"batches of up to {args.max_batch}, max wait {args.max_wait} s"
                        if args.max_batch > 1
                        else "no dynamic batching"
                    )
                    url = f"http://{args.host}:{port}"
                    where = f"; {devices[0].name} -> {devices[1].name}" if devices else ""
                    _out(f"{PROG}: serving on {url} ({batching}{where})")
                    for name, what in specs:
                        kind = (
                            f"{what} ({backend} on {device_specs[0]})"
                            if isinstance(what, str)
                            else f"MLP float32[n, {what}] -> float32[n, {what}]"
                        )
                        _out(
                            f"  model {name}: {kind}, POST /v2/models/{name}/infer "
                            "(Open Inference Protocol)"
                        )
                    name, first = specs[0]
                    if isinstance(first, int):
                        _out(
                            f"  POST /infer ({name}): one sample float32[{first}] or a batch "
                            f'float32[n, {first}], as JSON {{"inputs": ...}} or raw '
                            "little-endian bytes; GET /health, /stats, /metrics, /v2"
                        )
                    else:
                        _out(
                            f"  POST /infer ({name}, if it has one input and one output); "
                            "GET /health, /stats, /metrics, /v2"
                        )
                    sys.stdout.flush()
        if not forced:
            _out(f"{PROG}: drained, bye", sys.stderr)

    try:
        run_trio(main)
    except BaseExceptionGroup as group:  # the nursery wraps a startup error
        raise sole_error(group) from None
    return 130 if forced else 0


#: the collector's first threshold while serving (Python's default is 700 allocations)
GC_GEN0 = 20_000


def _settle_gc() -> None:
    """Tune the garbage collector of this process, once its models are ready, for serving.

    What was built (modules, the models, onnxruntime's session) lives as long as the server:
    ``gc.freeze()`` takes it out of every later collection, so the oldest generation's
    collections no longer walk it -- each stalled the event loop 15-45 ms under load, two to
    four of the batches' kernels at ``--hidden 16384``, the device idle throughout. A request
    leaves container garbage that reference counting frees; the collections of the youngest
    generation every 700 allocations cost ~10 % of the loop's time: every ``GC_GEN0`` instead.
    The process is this command's own, so its collector is too (``serve()`` leaves the
    host's alone)."""
    import gc

    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0, gen1, gen2)


def _onnx_build(
    path: str,
    backend: str,
    device: str,
    sizes: tuple[int, ...],
    name: str,
    depth: int,
    told: Callable[[str], None],
) -> Callable[[], AbstractAsyncContextManager[Any]]:
    """What builds an ONNX model: its own device opened, the file loaded onto it (each batch
    size's build told to ``told``)."""

    @asynccontextmanager
    async def build() -> AsyncIterator[Any]:
        import hcqa
        from hcqa import models

        async with hcqa.open_device(device) as dev:
            model = await models.load_onnx(
                path, device=dev, backend=backend, batch_sizes=sizes, name=name, depth=depth,
                progress=lambda k, n: told(f"building batch size {k} of {n}"),
            )  # fmt: skip
            yield model

    return build
