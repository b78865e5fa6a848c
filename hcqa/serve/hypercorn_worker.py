"""hypercorn's trio worker with every connection's failure kept inside that connection.

Theory of operation
-------------------
hypercorn 0.18's trio worker (``hypercorn.trio.run.worker_serve``) runs each connection --
``TCPServer(app, config, context, state)(stream)`` -- as a task of the nursery that also
serves its listeners, and nothing catches what a connection raises. Its protocol code does
raise on some byte sequences: a websocket upgrade with anything sent behind it before its
answer (a frame, garbage; with or without requests pipelined before it, whatever the app
does with websockets) makes h11 raise ``LocalProtocolError`` out of the connection. That
ended the nursery: every other connection was cut, the listeners closed, and later
connects were refused.

hypercorn has no hook for the per-connection handler, so this module builds, once at import,
a private copy of ``worker_serve`` -- the same code object, with ``__kwdefaults__`` copied --
whose globals are the ``hypercorn.trio.run`` module's with one name replaced: ``TCPServer``
is :func:`_guarded`, which awaits hypercorn's own ``TCPServer`` for the connection and
catches what escapes it. The exception is logged once (``hcqa.serve.hypercorn_worker``, at
ERROR, with the peer's address and the traceback) and the connection's stream is closed;
the other connections and the listeners go on. Cancellation passes through (a group that
mixes ``Cancelled`` with errors has its errors logged and the rest re-raised). Nothing of
hypercorn is patched: its modules and every other caller of its ``serve`` are untouched.

This reads hypercorn internals (the global name ``TCPServer`` in ``hypercorn.trio.run``
and the handler's signature), so it is pinned to the versions it was written and tested
against (:data:`SUPPORTED`), checked at import -- and this module is imported only by
``serve(http="hypercorn")``. With any other version, or if the internals moved,
:data:`UNGUARDED` says why and :func:`serve` warns (once per call) and runs hypercorn's own
``serve``, where one connection's protocol error can still end the server.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import re
import types
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import run as _run
from hypercorn.trio import serve as _hypercorn_serve
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import wrap_app

__all__ = ["SUPPORTED", "UNGUARDED", "serve"]

log = logging.getLogger("hcqa.serve.hypercorn_worker")

#: hypercorn versions the guard reads the internals of: ``low <= version < high``
SUPPORTED = ((0, 18), (0, 19))

_HANDLER = ["app", "config", "context", "state", "stream"]  # TCPServer's, as worker_serve calls it


def _unguardable(version: str, worker: Callable[..., Any], server: type) -> str | None:
    """Why the guard cannot be built for this hypercorn (None: it can)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    low, high = SUPPORTED
    if found is None or not low <= (int(found[1]), int(found[2])) < high:
        return (
            f"hypercorn {version} is not a version hcqa's connection guard knows "
            f"({low[0]}.{low[1]} <= version < {high[0]}.{high[1]})"
        )
    code = getattr(worker, "__code__", None)
    if code is None or getattr(worker, "__closure__", None) or "TCPServer" not in code.co_names:
        return f"hypercorn {version}'s worker_serve no longer looks up TCPServer by name"
    if list(inspect.signature(server).parameters) != _HANDLER:
        return f"hypercorn {version}'s TCPServer takes other arguments than {_HANDLER}"
    return None


async def _guarded(app: Any, config: Config, context: Any, state: Any, stream: Any) -> None:
    """One connection: hypercorn's ``TCPServer`` on ``stream``; what escapes it is logged
    and ends this connection only."""
    peer = _peer(stream)
    try:
        await TCPServer(app, config, context, state, stream)
    except Exception as exc:  # an ExceptionGroup too, when it holds no Cancelled
        _log_failure(peer, exc)
    except BaseExceptionGroup as group:  # errors beside a cancellation: log them, go on
        errors, rest = group.split(Exception)
        if errors is not None:
            _log_failure(peer, errors)
        if rest is not None:
            raise rest from None
    finally:
        await trio.aclose_forcefully(stream)  # closed already unless TCPServer failed closing


def _log_failure(peer: str, exc: BaseException) -> None:
    log.error(
        "a hypercorn connection from %s failed (%s); it is closed and the server goes on",
        peer,
        ", ".join(dict.fromkeys(_kinds(exc))),
        exc_info=exc,
    )


def _kinds(exc: BaseException) -> list[str]:
    """The names of the exceptions in ``exc`` (a group's, depth first)."""
    if isinstance(exc, BaseExceptionGroup):
        return [name for e in exc.exceptions for name in _kinds(e)]
    return [type(exc).__name__]


def _peer(stream: Any) -> str:
    """``host:port`` of the client on ``stream`` (a socket stream, or TLS over one)."""
    try:
        sock = getattr(stream, "transport_stream", stream).socket
        addr = sock.getpeername()
    except (AttributeError, OSError):
        return "an unknown peer"
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"[{addr[0]}]:{addr[1]}" if ":" in str(addr[0]) else f"{addr[0]}:{addr[1]}"
    return str(addr) or "a local socket"


def _guarded_worker() -> Callable[..., Awaitable[None]]:
    """``worker_serve`` running each connection through :func:`_guarded`."""
    worker = _run.worker_serve
    names = dict(vars(_run), TCPServer=_guarded)
    copy = types.FunctionType(worker.__code__, names, worker.__name__, worker.__defaults__)
    copy.__kwdefaults__ = dict(worker.__kwdefaults__ or {})
    return copy


UNGUARDED: str | None = _unguardable(
    importlib.metadata.version("hypercorn"), _run.worker_serve, TCPServer
)
_worker = None if UNGUARDED else _guarded_worker()


async def serve(
    app: Any,
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's trio ``serve(app, config)`` for an ASGI ``app``, each connection guarded
    (see the notes); hypercorn's own, with a warning, where the guard is not available."""
    if _worker is None:
        log.warning("%s: serving unguarded, one connection's error may end the server", UNGUARDED)
        await _hypercorn_serve(
            app, config, shutdown_trigger=shutdown_trigger, task_status=task_status
        )
        return
    await _worker(
        wrap_app(app, config.wsgi_max_body_size, "asgi"),
        config,
        shutdown_trigger=shutdown_trigger,
        task_status=task_status,
    )
