"""Running a served app: an HTTP server on trio, draining, and the demo MLP.

Theory of operation
-------------------
:func:`serve` opens the batchers (unless ``max_batch=1``), builds the app, and runs the
HTTP server -- :mod:`hcqa.serve.http` by default, or hypercorn's trio worker, each
connection guarded (:mod:`hcqa.serve.hypercorn_worker`) -- in the caller's trio run, so
the HTTP server, the batcher's collector, the pipeline's actors and the devices' wake-ups
share one loop while kernels run in engine threads or worker processes.
``task_status.started`` reports the bound port. When the shutdown trigger returns, the
drain starts: the server stops accepting and closes idle connections, every answer from
then on carries ``Connection: close`` (the app's counting middleware adds it whichever
server runs), and as soon as no request is inside the app (the middleware counts them; at
most ``grace_period`` seconds) the server is stopped -- it does not wait for connections
that will never carry another request (hypercorn would, for the whole grace period). Then
the batchers drain and :func:`serve` returns. hypercorn is imported only when it is asked
for.

The access log file is opened as the Tracer writes its trace: never through a symlink
(``O_NOFOLLOW``), created owner-only (0600), and only a regular file is accepted.

:func:`mlp_pipeline` is the two-layer MLP that ``hcqa serve`` and the examples run.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import ExitStack
from functools import partial
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import trio

from hcqa.devices.base import Device
from hcqa.devices.program import Program
from hcqa.errors import InvalidCommand, install_hint, sole_error
from hcqa.pipeline import Pipeline, Stage
from hcqa.serve.app import make_app
from hcqa.serve.hosted import Hosted, Model
from hcqa.serve.http import serve_http
from hcqa.serve.targets import is_model
from hcqa.serve.v2 import NAME_PATTERN

__all__ = ["mlp_pipeline", "serve"]

log = logging.getLogger("hcqa.serve")


async def serve(
    pipeline: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int | None = None,
    max_wait: float = 0.002,
    max_pending: int | None = None,
    grace_period: float = 10.0,
    max_body: int | None = None,
    body_timeout: float = 30.0,
    access_log: str | None = None,
    log_level: str = "WARNING",
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    handle_signals: bool = True,
    hypercorn_options: Mapping[str, Any] | None = None,
    http: str | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``pipeline`` over HTTP on ``host:port`` until cancelled or drained.

    What to serve: a :class:`hcqa.models.Model` (its own tensor names, shapes and batch
    sizes), a ``Pipeline`` or ``ProcessPipeline``, a list of pipelines taking the same rows
    in batches of different sizes (buckets, see :func:`hcqa.open_batcher`), an async batch
    callable (declare its tensors with a :class:`~hcqa.serve.Model`'s ``inputs`` and
    ``outputs``), or a list of :class:`~hcqa.serve.Model` (or of ``models.Model``, each
    under its name): each is served by the Open Inference Protocol
    (``/v2/models/{name}/infer``) with a batcher of its own; the first also answers
    ``/infer``. A lone pipeline or callable is the model named ``"model"``.

    The HTTP server starts at once (health endpoints answer); each model is built (a
    ``Model``'s ``build``), warmed up and batched in the background, and is ready
    (``/v2/models/{m}/ready``) only then. ``task_status.started(port)`` comes once every
    model is ready. A model that fails to build ends ``serve`` with
    :class:`~hcqa.serve.hosted.ModelFailed` naming the model and why.

    Single samples are batched (:func:`hcqa.open_batcher`, ``max_batch`` -- default the
    model's largest batch -- and ``max_wait``); ``max_batch=1`` turns batching off.
    ``port=0`` picks a free port; ``await nursery.start(partial(serve, pipe, port=0))``
    returns the bound port. When ``shutdown_trigger()`` returns, the server drains: it stops
    accepting, answers the requests in flight (with ``Connection: close``) for up to
    ``grace_period`` seconds, and returns as soon as they are answered. Without a trigger,
    SIGTERM and SIGINT start that drain (a second one stops at once) unless
    ``handle_signals=False`` (for hosts that own the signals; only the main thread can
    take them). ``max_body``: the largest request body (default: see
    :func:`hcqa.serve.make_app`). ``body_timeout``: seconds a request's body may take to
    arrive (408 past it); a request is admitted (see ``max_pending``) only once its body
    has arrived. ``access_log``: ``"-"`` for stdout, a file path (appended to; created with
    mode 0600; a symlink or anything but a regular file is refused with InvalidCommand), or
    None. A single startup error (``OSError`` for a port in use) is raised unwrapped.
    ``hypercorn_options`` sets more attributes of hypercorn's ``Config`` (``certfile``,
    ``keep_alive_timeout``, ...).

    ``http``: the HTTP server: ``"hcqa"`` (:mod:`hcqa.serve.http`, lean HTTP/1.1, the
    default) or ``"hypercorn"`` (TLS, HTTP/2; the default when ``hypercorn_options`` are
    given).
    """
    http = http or ("hypercorn" if hypercorn_options else "hcqa")
    if http not in ("hcqa", "hypercorn"):
        raise InvalidCommand(f"'http' must be 'hcqa' or 'hypercorn' (got {http!r})")
    if hypercorn_options and http != "hypercorn":
        raise InvalidCommand("hypercorn_options need http='hypercorn'")
    if not (isinstance(grace_period, int | float) and 0 <= grace_period < math.inf):
        raise InvalidCommand(f"'grace_period' must be a finite number >= 0 (got {grace_period!r})")
    if not (isinstance(body_timeout, int | float) and 0 < body_timeout < math.inf):
        raise InvalidCommand(f"'body_timeout' must be a finite number > 0 (got {body_timeout!r})")
    models = _models(pipeline, max_batch, max_wait)
    hosted = [Hosted(m) for m in models]
    app: Any = make_app(
        hosted=hosted, max_pending=max_pending, max_body=max_body, body_timeout=body_timeout
    )
    logger = None if access_log is None else _access_logger(access_log)
    if http == "hypercorn":
        start: Any = _hypercorn(host, port, grace_period, logger, log_level, hypercorn_options)
    else:
        start = partial(
            serve_http, host=host, port=port, grace_period=float(grace_period), access_log=logger
        )
    signals = shutdown_trigger is None and handle_signals
    if signals and threading.current_thread() is not threading.main_thread():
        signals = False  # only the main thread can take signals: the host owns them
    try:
        with ExitStack() as exits, trio.CancelScope() as everything:
            receiver = None
            if signals:
                receiver = exits.enter_context(trio.open_signal_receiver(*_SIGNALS))
            async with trio.open_nursery() as nursery:
                if receiver is not None:
                    stop = trio.Event()
                    nursery.start_soon(_watch_signals, receiver, stop, everything, grace_period)
                    shutdown_trigger = stop.wait
                for h in hosted:
                    nursery.start_soon(h.keep)
                await _run(start, app, hosted, shutdown_trigger, grace_period, task_status)
                nursery.cancel_scope.cancel()  # drained: the models' batchers close
    except BaseExceptionGroup as group:  # nurseries wrap one error (port in use, Ctrl-C)
        raise sole_error(group) from None
    finally:
        for handler in logger.handlers if logger is not None else ():
            handler.close()


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def _watch_signals(
    receiver: Any, stop: trio.Event, everything: trio.CancelScope, grace_period: float
) -> None:
    """The first signal starts the drain; a second stops at once."""
    async for signum in receiver:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("%s again: stopping now", name)
            everything.cancel()
            return
        log.warning("%s: draining, up to %s s for requests in flight", name, grace_period)
        stop.set()


async def _run(
    start: Any,
    app: Any,
    hosted: Sequence[Hosted],
    shutdown_trigger: Callable[[], Awaitable[None]] | None,
    grace_period: float,
    task_status: trio.TaskStatus[int],
) -> None:
    """Run the HTTP server until cancelled or, with a trigger, drained (see the notes)."""
    state = app.state
    draining = trio.Event()
    anyio.current_time()  # anyio loads its trio backend now, not inside the first request

    async def trigger() -> None:
        assert shutdown_trigger is not None
        await shutdown_trigger()
        state.draining = True  # from now on every answer says Connection: close
        draining.set()

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(start, app, shutdown_trigger=None if shutdown_trigger is None else trigger)
        )
        for h in hosted:  # the health endpoints answer meanwhile
            await h.wait_ready()
        task_status.started(int(binds[0].rsplit(":", 1)[1]))
        if shutdown_trigger is None:
            return
        await draining.wait()
        with trio.move_on_after(grace_period):
            while True:  # idle, and still idle a moment later: nothing was on its way in
                await state.wait_idle()
                await trio.sleep(_SETTLE)
                if not state.active:
                    break
        nursery.cancel_scope.cancel()  # connections left carry no request: close them


_SETTLE = 0.01  # seconds the app must stay idle before a drain ends


def _hypercorn(
    host: str,
    port: int,
    grace_period: float,
    access_log: logging.Logger | None,
    log_level: str,
    options: Mapping[str, Any] | None,
) -> Any:
    """hypercorn's trio worker (each connection guarded: :mod:`hcqa.serve.hypercorn_worker`)
    with its ``Config`` bound: ``start(app, shutdown_trigger=)``."""
    try:
        from hypercorn.config import Config

        from hcqa.serve.hypercorn_worker import serve as hypercorn_serve
    except ImportError as exc:
        raise ImportError(f"hcqa.serve needs hypercorn: {install_hint('serve')}") from exc
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.loglevel = log_level
    config.graceful_timeout = float(grace_period)
    if access_log is not None:
        config.accesslog = access_log
        config.access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss'
    for key, value in (options or {}).items():
        if not hasattr(config, key):
            raise InvalidCommand(f"hypercorn's Config has no option {key!r} (got it in 'options')")
        setattr(config, key, value)

    def start(app: Any, **kwargs: Any) -> Any:
        return hypercorn_serve(app, config, **kwargs)

    return start


def _access_logger(target: str) -> logging.Logger:
    """A logger (not registered with ``logging``) writing one line per request to stdout
    (``"-"``) or appending to a file, opened without following a symlink."""
    logger = logging.Logger(f"hcqa.serve.access:{target}", logging.INFO)
    logger.propagate = False
    handler = logging.StreamHandler(sys.stdout) if target == "-" else _LogFile(_open_log(target))
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)
    return logger


def _models(pipeline: Any, max_batch: int | None, max_wait: float) -> list[Model]:
    """What to serve as a list of models (a lone pipeline or callable is the model "model")."""
    if isinstance(pipeline, Model):
        return [pipeline]
    many = isinstance(pipeline, list | tuple) and bool(pipeline)
    if many and all(isinstance(m, Model) for m in pipeline):
        found = list(pipeline)
    elif many and all(is_model(m) for m in pipeline):
        found = [
            Model(name=_name_of(m), pipeline=m, max_batch=max_batch, max_wait=max_wait)
            for m in pipeline
        ]
    elif many and any(isinstance(m, Model) or is_model(m) for m in pipeline):
        raise InvalidCommand(
            "serve takes one model or pipeline, a list of pipelines (buckets), or a list of "
            f"models (got a mix: {[type(m).__name__ for m in pipeline]})"
        )
    else:
        name = _name_of(pipeline) if is_model(pipeline) else "model"
        return [Model(name=name, pipeline=pipeline, max_batch=max_batch, max_wait=max_wait)]
    names = [m.name for m in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidCommand(f"model names must differ (got {', '.join(twice)} twice)")
    return found


def _name_of(model: Any) -> str:
    """A ``models.Model``'s name where it is a valid URL name, else ``"model"``."""
    name = getattr(model, "name", None)
    return name if isinstance(name, str) and NAME_PATTERN.fullmatch(name) else "model"


class _LogFile(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that closes its file when it is closed."""

    def close(self) -> None:
        super().close()
        self.stream.close()


def _open_log(path: str) -> Any:
    """``path`` opened for appending: created 0600, never through a symlink, regular only."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        try:
            st = os.lstat(path)
        except OSError:
            pass
        else:
            if stat.S_ISLNK(st.st_mode):
                raise InvalidCommand(
                    f"access_log {path!r} must be a regular file (got a symlink, "
                    "which is not followed)"
                ) from None
            if not stat.S_ISREG(st.st_mode):
                raise InvalidCommand(
                    f"access_log {path!r} must be a regular file (got {_kind(st)})"
                ) from None
        raise InvalidCommand(
            f"access_log {path!r} must be a file this user can append to (got: {exc.strerror})"
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InvalidCommand(f"access_log {path!r} must be a regular file (got {_kind(st)})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


def _kind(st: os.stat_result) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(st.st_mode):
            return name
    return "not a regular file"


async def mlp_pipeline(
    d0: Device,
    d1: Device,
    *,
    batch: int = 32,
    width: int = 256,
    depth: int = 2,
    seed: int = 0,
    sleep: float = 0.0,
    buckets: Sequence[int] = (),
) -> Any:
    """A two-layer MLP with random weights: ``relu(x @ w1)`` on ``d0``, ``@ w2`` on ``d1``.

    On cpu devices the layers are numpy matmuls; on OpenCL devices, OpenCL C kernels (one
    work-item per output element).

    Input and output are ``float32[batch, width]``; each layer is ``2 * batch * width**2``
    flops, so ``width`` sets how long a microbatch keeps each device busy. ``sleep`` adds
    that many seconds to each layer's kernel without using the host CPU (GIL released), as
    an accelerator's kernel looks from the host.

    ``buckets``: batch sizes smaller than ``batch`` for which to build pipelines too, sharing
    the weights; then the result is the list of pipelines, smallest first (a target for
    :func:`serve` and :func:`hcqa.open_batcher`: a lone sample runs in the batch-1 pipeline
    instead of being padded to ``batch`` rows).
    """
    rng = np.random.default_rng(seed)
    scale = np.float32(1 / math.sqrt(width))
    w1 = d0.alloc(shape=(width, width), dtype="float32")
    w2 = d1.alloc(shape=(width, width), dtype="float32")
    for buf in (w1, w2):
        await buf.copyin(rng.standard_normal((width, width), dtype=np.float32) * scale)

    sizes = sorted({b for b in buckets if b < batch} | {batch})
    if d0.kind == "opencl" or d1.kind == "opencl":
        if sleep:
            raise InvalidCommand(f"'sleep' needs cpu devices (got {d0.name}, {d1.name})")
        progs = [await d.program_async("dense", _DENSE_CL, entry="dense") for d in (d0, d1)]
        pipes = [
            Pipeline(
                _opencl_stages((d0, d1), progs, (w1, w2), b, width),
                in_shape=(b, width),
                depth=depth,
            )
            for b in sizes
        ]
        return pipes if buckets else pipes[0]

    def dense_relu(out: npt.NDArray[Any], x: npt.NDArray[Any], w: npt.NDArray[Any]) -> None:
        if sleep:
            time.sleep(sleep)
        np.matmul(x, w, out=out)
        np.maximum(out, 0, out=out)

    def dense(out: npt.NDArray[Any], x: npt.NDArray[Any], w: npt.NDArray[Any]) -> None:
        if sleep:
            time.sleep(sleep)
        np.matmul(x, w, out=out)

    stages = [
        Stage(device=d0, program=d0.program("dense_relu", dense_relu), params=(w1,)),
        Stage(device=d1, program=d1.program("dense", dense), params=(w2,)),
    ]
    pipes = [Pipeline(stages, in_shape=(b, width), depth=depth) for b in sizes]
    return pipes if buckets else pipes[0]


# One work-item per output element: out[r, c] = sum_k x[r, k] * w[k, c], then relu if asked.
_DENSE_CL = """
__kernel void dense(__global float *out, __global const float *x, __global const float *w,
                    int width, int relu) {
    const int c = get_global_id(0), r = get_global_id(1);
    float acc = 0.0f;
    for (int k = 0; k < width; k++) acc += x[r * width + k] * w[k * width + c];
    out[r * width + c] = (relu && acc < 0.0f) ? 0.0f : acc;
}
"""


def _opencl_stages(
    devices: Sequence[Device],
    progs: Sequence[Program],
    weights: Sequence[Any],
    rows: int,
    width: int,
) -> list[Stage]:
    """The MLP's two layers as OpenCL C kernels (built, one per device), an NDRange of
    ``width x rows`` work-items."""
    return [
        Stage(
            device=device,
            program=prog,
            params=(w,),
            vals=(width, relu),
            global_size=(width, rows, 1),
            local_size=(1, 1, 1),
        )
        for device, prog, w, relu in zip(devices, progs, weights, (1, 0), strict=True)
    ]
