"""A lean HTTP/1.1 server for an ASGI app on trio: the default host of :func:`hcqa.serve.serve`.

Theory of operation
-------------------
Two trio tasks per connection: a *reader* that reads the socket for the connection's
whole life and hands the bytes to the connection's parser (:mod:`hcqa.serve.http_head`:
llhttp, with hcqa's checks and limits on top), which queues the requests and their body
pieces (one read waiting per connection, instead of a fresh wait per request and per
disconnect watch; it pauses at 1 MiB queued until a request asks for more), and the
request loop, which takes the next request's head from the queue (a malformed one is
answered ``400``, ``431`` or ``505`` and the connection closes), builds the ASGI scope and
awaits the app with the request's ``receive`` and ``send``
(:mod:`hcqa.serve.http_exchange`: the body in from the queue, the response out, in one
``send_all`` when it is complete in one message).

Keep-alive: HTTP/1.1 keeps the connection unless a side says ``Connection: close``;
HTTP/1.0 closes unless the client asks to keep it. An idle connection waits
``keep_alive_timeout`` seconds for the next request's first byte, then closes; a head
must arrive within ``head_timeout`` seconds of its first byte (``408``). Bodies are
bounded by the app (it reads them).

Draining: when ``shutdown_trigger()`` returns, the listeners close (new connections are
refused) and requests in flight get ``grace_period`` seconds to finish (their responses
say ``Connection: close``). Idle keep-alive connections stay open meanwhile: a request
that arrives on one during the drain is answered ``503`` with ``Connection: close`` (it
was not run, so the client may send it elsewhere) rather than met by a closed connection,
which would leave a client unsure whether its POST ran. Once nothing is in flight,
whatever is left is cancelled and :func:`serve_http` returns.

An exception from the app before its response started is answered ``500`` (and logged);
after, the connection just closes. Any other exception met while serving a connection (a
bug) ends that connection, logged, never the server. A client that leaves makes ``send`` a no-op and
``receive`` say ``http.disconnect``.

Where each part lives: this module holds the server (:func:`serve_http`, draining) and the
connection (its reader, the request loop, the ASGI scope); :mod:`hcqa.serve.http_head`
parses and checks the requests; :mod:`hcqa.serve.http_exchange` is one request's
``receive`` (the body, then the disconnect) and ``send`` (the response's framing).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from hcqa.serve.http_exchange import _Exchange
from hcqa.serve.http_head import _GONE, _PHRASES, _BadRequest, _date, _Parser, _Request

__all__ = ["BODY", "DISCONNECT", "serve_http"]

_log = logging.getLogger("hcqa.serve.http")
_MAX_BUFFER = 1 << 20  # queued bytes: the reader stops here until the request asks for more
#: ASGI scope extension: ``scope["extensions"][DISCONNECT](callback)`` calls ``callback()``
#: when the client leaves before its response is complete (see ``_Exchange.on_disconnect``)
DISCONNECT = "hcqa.disconnect"
#: ASGI scope extension: ``scope["extensions"][BODY]()`` is the whole request body when all of
#: it has arrived and none was read yet (it is read then), else None: read it with ``receive``
BODY = "hcqa.body"
_READ = 1 << 16


class _Server:
    def __init__(
        self,
        app: Any,
        *,
        keep_alive_timeout: float,
        head_timeout: float,
        access_log: logging.Logger | None,
    ) -> None:
        self.app = app
        self.keep_alive_timeout = keep_alive_timeout
        self.head_timeout = head_timeout
        self.access_log = access_log
        self.draining = False
        self.busy = 0  # connections inside a request
        self.quiet = trio.Event()  # set while no connection is inside a request
        self.quiet.set()

    def drain(self) -> None:
        self.draining = True  # idle connections stay: a request on one now gets a 503

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            sock = stream.socket
            client = sock.getpeername()[:2]
            server = sock.getsockname()[:2]
            await _Connection(self, stream, client, server).run()
        except Exception as exc:  # one connection's failure ends that connection, not the server
            if not _gone(exc):
                _log.exception("a connection failed; it is closed and the server goes on")
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()


def _gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or every exception of a group) says the client went away."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_gone(e) for e in exc.exceptions)
    return isinstance(exc, _GONE)


class _Connection:
    def __init__(self, server: _Server, stream: trio.SocketStream, client: Any, addr: Any) -> None:
        self.srv = server
        self.stream = stream
        self.client = (str(client[0]), int(client[1]))
        self.addr = (str(addr[0]), int(addr[1]))
        self.parser = _Parser()
        self.exchange: _Exchange | None = None  # the request being answered
        self.eof = False  # the client closed its side (or the connection broke)
        self._news = trio.Event()  # set (and replaced) when data or EOF arrives
        self._room = trio.Event()  # set when the reader may read past _MAX_BUFFER
        self._room.set()

    async def _reader(self) -> None:
        """Read the socket for the whole connection: one read waiting at a time, and EOF
        seen while a request runs."""
        try:
            parser = self.parser
            while True:
                if parser.backlog >= _MAX_BUFFER:  # nobody asked for more: wait until they do
                    self._room = trio.Event()
                    await self._room.wait()
                data = await self.stream.receive_some(_READ)
                if not data:
                    return
                try:
                    parser.feed(data)  # after a malformed request: read (for EOF) and drop
                except Exception:  # a bug: this connection's 500, not the server's end
                    _log.exception("parsing a request failed")
                    parser.fail(_BadRequest(500, "Internal Server Error"))
                self._notify()
        except _GONE:
            return
        finally:
            self.eof = True
            self._notify()
            ex, self.exchange = self.exchange, None
            if ex is not None:
                ex.disconnected()

    def _notify(self) -> None:
        self._news.set()
        self._news = trio.Event()

    async def _changed(self) -> None:
        """Wait for more data or EOF."""
        if not self.eof:
            await self._news.wait()

    async def _fill(self) -> None:
        """Wait for more data or EOF, letting the reader read past its buffer limit."""
        self._room.set()
        await self._changed()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._reader)
            try:
                await self._requests()
            finally:
                nursery.cancel_scope.cancel()

    async def _requests(self) -> None:
        srv = self.srv
        while True:
            parser = self.parser
            if not parser.started():  # wait for the next request's first byte
                with trio.move_on_after(srv.keep_alive_timeout):
                    while not parser.started() and not self.eof:
                        await self._fill()
            if not parser.started():
                return  # idle timeout or EOF
            late = srv.draining  # this request began after the drain did
            srv.busy += 1
            srv.quiet = trio.Event() if srv.busy == 1 else srv.quiet
            try:
                keep = await self._request(late)
            finally:
                srv.busy -= 1
                if srv.busy == 0:
                    srv.quiet.set()
            if not keep:
                return

    async def _head(self) -> _Request | None:
        """The next request's head, or None when the client left first."""
        events = self.parser.events
        if not events:  # (a head already parsed needs no timeout: no cancel scope a request)
            with trio.move_on_after(self.srv.head_timeout):
                while not events:
                    if self.eof:
                        return None
                    await self._fill()
            if not events:
                raise _BadRequest(408, "request head not received in time")
        event = events.popleft()
        if isinstance(event, _BadRequest):
            raise event
        assert isinstance(event, _Request), event  # bodies are taken by their exchange
        self.parser.backlog -= event.size
        return event

    async def _request(self, late: bool) -> bool:
        t0 = time.perf_counter()
        try:
            req = await self._head()
            if req is None:
                return False
        except _BadRequest as exc:
            await self._plain(exc.status, str(exc))
            return False
        except Exception:  # a request the checks missed: this connection's 500, not a crash
            _log.exception("reading a request head failed")
            await self._plain(500, "Internal Server Error")
            return False
        if late:  # not run: the client may safely send it to another server
            await self._plain(503, "the server is shutting down; send the request elsewhere")
            if self.srv.access_log is not None:
                self.srv.access_log.info(
                    '%s "%s %s %s" 503 0 %.6fs',
                    self.client[0],
                    req.method,
                    req.target,
                    req.version,
                    time.perf_counter() - t0,
                )
            return False
        ex = _Exchange(self, req, t0)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": req.version,
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.raw_path,
            "query_string": req.query,
            "root_path": "",
            "headers": req.headers,
            "client": self.client,
            "server": self.addr,
            "state": {},
            "extensions": {DISCONNECT: ex.on_disconnect, BODY: ex.queued_body},
        }
        self.exchange = ex
        try:
            await self.srv.app(scope, ex.receive, ex.send)
        except _GONE:
            ex.keep = False
        except Exception:
            _log.exception("the app raised while answering %s %s", req.method, req.path)
            if not ex.started:
                await self._plain(500, "Internal Server Error")
            return False
        finally:
            self.exchange = None
        if ex.bad is not None:  # the body was malformed (the app saw a disconnect)
            await self._plain(ex.bad.status, str(ex.bad))
            return False
        if not ex.done:
            if not ex.started:
                await self._plain(500, "the app returned without a response")
            return False
        if not ex.body_done:  # the app did not read the whole body: can't find the next request
            ex.keep = False
        return ex.keep and not self.eof

    async def _plain(self, status: int, message: str) -> None:
        body = message.encode()
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\ndate: %s\r\n\r\n"
            % (status, _PHRASES.get(status, b""), len(body), _date())
        )
        try:
            await self.stream.send_all(head + body)
        except _GONE:
            pass


async def serve_http(
    app: Any,
    *,
    host: str,
    port: int,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    grace_period: float = 10.0,
    keep_alive_timeout: float = 5.0,
    head_timeout: float = 30.0,
    access_log: logging.Logger | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``host:port`` until cancelled, or drained after
    ``shutdown_trigger()`` returns; ``task_status.started`` gets ``["http://host:port"]``."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    srv = _Server(
        app, keep_alive_timeout=keep_alive_timeout, head_timeout=head_timeout, access_log=access_log
    )
    bound = listeners[0].socket.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            for listener in listeners:
                accepting.start_soon(
                    partial(
                        trio.serve_listeners, srv.handle, [listener], handler_nursery=connections
                    )
                )
            task_status.started([f"http://{shown}:{bound[1]}"])
            if shutdown_trigger is None:
                await trio.sleep_forever()
            await shutdown_trigger()
            srv.drain()  # before the listeners close: a refused connect means draining
            accepting.cancel_scope.cancel()
        for listener in listeners:
            with trio.CancelScope(shield=True):
                await listener.aclose()
        with trio.move_on_after(grace_period if grace_period < math.inf else 1e9):
            await srv.quiet.wait()
        connections.cancel_scope.cancel()
