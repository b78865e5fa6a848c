"""``hcqa serve``: a demo MLP over HTTP (see docs/serving.md).

Arguments are parsed into checked values (a port, seconds, integers with a minimum) so a
bad one is a one-line usage error before any device opens. The command opens ``cpu:0``
and ``cpu:1``, builds the MLP and runs :func:`hcqa.serve.serve` with SIGINT and SIGTERM
wired to a drain; a second signal stops at once (exit status 130): it cancels the scope
around the devices, so they close by cancellation -- what is queued on them is dropped,
not run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack

from hcqa.cli._base import PROG, CliError, _out, run_trio
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


def _model(text: str) -> tuple[str, int]:
    from hcqa.serve.v2 import NAME_PATTERN  # only re, attrs and starlette-free names: cheap

    name, sep, width = text.rpartition(":")
    if not sep or not NAME_PATTERN.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"must be NAME:WIDTH, NAME 1-64 letters, digits, '_', '.' or '-' (got {text!r})"
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
        help="where the MLP's layers run: cpu:0 -> cpu:1 (numpy), or two devices on opencl:0 "
        "(OpenCL C kernels) (default: %(default)s)",
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
        metavar="NAME:WIDTH",
        help="serve an MLP of this width under this name (repeat for several models, each "
        "with its own batcher; the first also answers /infer); default: mlp:WIDTH",
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
        help="batches on the devices at once (default: %(default)s)",
    )
    add(
        "--sleep-ms",
        type=_seconds,
        default=0.0,
        help="milliseconds each layer's kernel also sleeps, leaving the host idle as an "
        "accelerator does (default: %(default)s)",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Serve a demo 2-stage MLP (cpu:0 -> cpu:1, random weights) over HTTP; drain on a signal."""
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

    specs: list[tuple[str, int]] = args.model or [("mlp", args.width)]
    names = [name for name, _ in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CliError(f"--model names must differ (got {', '.join(twice)} twice)")
    if args.device == "opencl" and args.sleep_ms:
        raise CliError("--sleep-ms needs --device cpu (an OpenCL kernel can't sleep)")
    device_specs = ("cpu:0", "cpu:1") if args.device == "cpu" else ("opencl:0", "opencl:0")
    forced = False

    async def main() -> None:
        nonlocal forced
        stop = trio.Event()
        everything = trio.CancelScope()  # a second signal cancels it: the devices drop work
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals, everything:
            async with AsyncExitStack() as stack:
                try:
                    d0, d1 = await stack.enter_async_context(hcqa.open_devices(*device_specs))
                except InvalidCommand as exc:
                    raise CliError(f"hcqa serve --device {args.device}: {exc}") from None
                models = []
                for name, width in specs:
                    pipes = await mlp_pipeline(
                        d0,
                        d1,
                        batch=args.max_batch,
                        width=width,
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
                        await serve(
                            models,
                            host=args.host,
                            port=args.port,
                            max_batch=args.max_batch,
                            max_wait=args.max_wait,
                            max_pending=args.max_pending,
                            grace_period=args.grace_period,
                            body_timeout=args.body_timeout,
                            access_log=None if args.access_log == "none" else args.access_log,
                            shutdown_trigger=stop.wait,
                            http=args.http,
                            task_status=task_status,
                        )
                        nursery.cancel_scope.cancel()  # drained: stop watching for signals

                    nursery.start_soon(on_signals)
                    port = await nursery.start(server)
                    batching = (
                        f"batches of up to {args.max_batch}, max wait {args.max_wait} s"
                        if args.max_batch > 1
                        else "no dynamic batching"
                    )
                    url = f"http://{args.host}:{port}"
                    _out(f"{PROG}: serving on {url} ({batching}; {d0.name} -> {d1.name})")
                    for name, width in specs:
                        _out(
                            f"  model {name}: MLP float32[n, {width}] -> float32[n, {width}], "
                            f"POST /v2/models/{name}/infer (Open Inference Protocol)"
                        )
                    first = specs[0][1]
                    _out(
                        f"  POST /infer ({specs[0][0]}): one sample float32[{first}] or a batch "
                        f'float32[n, {first}], as JSON {{"inputs": ...}} or raw '
                        "little-endian bytes; GET /health, /stats, /metrics, /v2"
                    )
                    sys.stdout.flush()
        if not forced:
            _out(f"{PROG}: drained, bye", sys.stderr)

    try:
        run_trio(main)
    except BaseExceptionGroup as group:  # the nursery wraps a startup error
        raise sole_error(group) from None
    return 130 if forced else 0
