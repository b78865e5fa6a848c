"""A lean HTTP/1.1 server for an ASGI app on trio: the default host of :func:`hcqa.serve.serve`.

Theory of operation
-------------------
Two trio tasks per connection: a *reader* that reads the socket for the connection's
whole life into a buffer (one read waiting per connection, instead of a fresh wait per
request and per disconnect watch; it pauses at 1 MiB until a request asks for more), and
the request loop, which gathers the head (request line and headers, at most 64 KiB) from
the buffer, checks it (a malformed line, a header folded over lines, both
``Content-Length`` and ``Transfer-Encoding``, a length that is not a number, a target
that is not a path: ``400`` and the connection closes), builds the ASGI scope and awaits
the app. The app's ``receive`` hands out the body from the buffer (``Content-Length`` or
chunked); once the body is read, a ``receive`` waits for the reader to see EOF and says
``http.disconnect`` -- bytes that arrive meanwhile are the next pipelined request and
stay in the buffer.

The app's ``send`` collects the response head; the head and a body that is complete in
one message (what Starlette's ``Response`` sends) leave in one ``send_all`` -- one
syscall per response. A streamed body goes out chunked unless the app gave a length.

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
after, the connection just closes. A client that leaves makes ``send`` a no-op and
``receive`` say ``http.disconnect``.
"""

from __future__ import annotations

import email.utils
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from functools import partial
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import trio

__all__ = ["DISCONNECT", "serve_http"]

_log = logging.getLogger("hcqa.serve.http")
_MAX_HEAD = 1 << 16
_MAX_BUFFER = 1 << 20
#: ASGI scope extension: ``scope["extensions"][DISCONNECT](callback)`` calls ``callback()``
#: when the client leaves before its response is complete (see ``_Exchange.on_disconnect``)
DISCONNECT = "hcqa.disconnect"  # the reader stops here until the request asks for more
_READ = 1 << 16
_PHRASES = {s.value: s.phrase.encode() for s in HTTPStatus}
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_date_cache: tuple[int, bytes] = (0, b"")


def _date() -> bytes:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True).encode())
    return _date_cache[1]


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
        except _GONE:
            pass
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()


class _Connection:
    def __init__(self, server: _Server, stream: trio.SocketStream, client: Any, addr: Any) -> None:
        self.srv = server
        self.stream = stream
        self.client = (str(client[0]), int(client[1]))
        self.addr = (str(addr[0]), int(addr[1]))
        self.buf = bytearray()
        self.exchange: _Exchange | None = None  # the request being answered
        self.eof = False  # the client closed its side (or the connection broke)
        self._news = trio.Event()  # set (and replaced) when data or EOF arrives
        self._room = trio.Event()  # set when the reader may read past _MAX_BUFFER
        self._room.set()

    async def _reader(self) -> None:
        """Read the socket for the whole connection: one read waiting at a time, and EOF
        seen while a request runs."""
        try:
            while True:
                if len(self.buf) >= _MAX_BUFFER:  # nobody asked for more: wait until they do
                    self._room = trio.Event()
                    await self._room.wait()
                data = await self.stream.receive_some(_READ)
                if not data:
                    return
                self.buf += data
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
            if not self.buf:  # wait for the next request's first byte
                with trio.move_on_after(srv.keep_alive_timeout):
                    while not self.buf and not self.eof:
                        await self._fill()
            if not self.buf:
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

    async def _head(self) -> bytes | None:
        with trio.move_on_after(self.srv.head_timeout):
            while True:
                end = self.buf.find(b"\r\n\r\n", 0, _MAX_HEAD + 4)
                if end >= 0:
                    head = bytes(self.buf[:end])
                    del self.buf[: end + 4]
                    return head
                if len(self.buf) > _MAX_HEAD:
                    raise _BadRequest(431, "request head larger than 64 KiB")
                _check_partial_head(self.buf)
                if self.eof:
                    return None
                await self._fill()
        raise _BadRequest(408, "request head not received in time")

    async def _request(self, late: bool) -> bool:
        t0 = time.perf_counter()
        try:
            head = await self._head()
            if head is None:
                return False
            req = _Request.parse(head)
        except _BadRequest as exc:
            await self._plain(exc.status, str(exc))
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
            "extensions": {DISCONNECT: ex.on_disconnect},
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


_BARE_LF = re.compile(rb"(?<!\r)\n")


def _check_partial_head(buf: bytearray) -> None:
    """Refuse a head that can never end well before waiting for the rest of it: a line
    ended by a bare LF (the head would never end with CRLF CRLF) or a complete request
    line without a version (HTTP/0.9, whose client waits for an answer, not a 408)."""
    if _BARE_LF.search(buf, 0, _MAX_HEAD) is not None:
        raise _BadRequest(400, "the lines of a request head must end with CRLF (got a bare LF)")
    end = buf.find(b"\r\n", 0, _MAX_HEAD)
    if end >= 0:
        _request_line(bytes(buf[:end]))


def _request_line(line: bytes) -> list[bytes]:
    """The request line's three parts (method, target, ``HTTP/...``), or 400."""
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        raise _BadRequest(400, "malformed request line")
    return parts


class _Request:
    __slots__ = (
        "body_left",
        "chunked",
        "continue_",
        "headers",
        "keep",
        "method",
        "path",
        "query",
        "raw_path",
        "target",
        "version",
    )

    @classmethod
    def parse(cls, head: bytes) -> _Request:
        lines = head.split(b"\r\n")
        parts = _request_line(lines[0])
        r = cls()
        r.method = parts[0].decode("ascii", "replace")
        if not r.method.isalpha() or not r.method.isupper():
            raise _BadRequest(400, "malformed method")
        r.version = parts[2][5:].decode("ascii", "replace")
        if r.version not in ("1.0", "1.1"):
            raise _BadRequest(505, "HTTP version not supported")
        target = parts[1]
        if not target.startswith(b"/"):
            raise _BadRequest(400, "the request target must be a path")
        r.target = target.decode("latin-1")
        raw_path, _, r.query = target.partition(b"?")
        r.raw_path = raw_path
        r.path = unquote(raw_path.decode("latin-1"))
        headers: list[tuple[bytes, bytes]] = []
        length: bytes | None = None
        te: bytes | None = None
        connection = b""
        expect = b""
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip() or b" " in name or b"\t" in name:
                raise _BadRequest(400, "malformed header line")
            name = name.lower()
            value = value.strip(b" \t")
            headers.append((name, value))
            if name == b"content-length":
                if not value.isdigit() or (length is not None and value != length):
                    raise _BadRequest(400, "bad Content-Length")
                length = value
            elif name == b"transfer-encoding":
                te = value.lower()
            elif name == b"connection":
                connection = value.lower()
            elif name == b"expect":
                expect = value.lower()
        if te is not None and (length is not None or te != b"chunked"):
            raise _BadRequest(400, "unsupported Transfer-Encoding (only chunked, no length)")
        r.headers = headers
        r.chunked = te is not None
        r.body_left = int(length) if length is not None else 0
        r.continue_ = expect == b"100-continue"
        if r.version == "1.1":
            r.keep = b"close" not in connection
        else:
            r.keep = b"keep-alive" in connection
        return r

    method: str
    version: str
    target: str
    raw_path: bytes
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    chunked: bool
    body_left: int
    continue_: bool
    keep: bool


class _Exchange:
    """One request's ``receive`` and ``send``."""

    def __init__(self, conn: _Connection, req: _Request, t0: float) -> None:
        self.t0 = t0
        self.conn = conn
        self.req = req
        self.keep = req.keep
        self.body_done = not req.chunked and req.body_left == 0
        self.started = False
        self.done = False
        self.status = 0
        self.sent = 0
        self.head: list[tuple[bytes, bytes]] = []
        self.length: int | None = None
        self.chunked_out = False
        self.gone = False
        self.callbacks: list[Callable[[], object]] = []

    def on_disconnect(self, callback: Callable[[], object]) -> Callable[[], None]:
        """The ``hcqa.disconnect`` extension: call ``callback()`` (on the loop's thread) if the
        client leaves before the response is complete; returns a function that unregisters it."""
        if self.conn.eof and not self.done:
            callback()
            return lambda: None
        self.callbacks.append(callback)
        return lambda: self.callbacks.remove(callback) if callback in self.callbacks else None

    def disconnected(self) -> None:
        if not self.done:
            callbacks, self.callbacks = self.callbacks, []
            for callback in callbacks:
                callback()

    # -- receive ---------------------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        if not self.asked:  # the first message is the body's, even an empty one
            self.asked = True
            if self.body_done:
                return {"type": "http.request", "body": b"", "more_body": False}
        if not self.body_done:
            try:
                chunk = await self._body_chunk()
            except _GONE:
                self.gone = True
                return {"type": "http.disconnect"}
            except _BadRequest as exc:  # a malformed chunked body: the host answers it, not
                self.bad = exc  # the app (to the app the client is gone; its answer is dropped)
                self.gone = True
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": chunk, "more_body": not self.body_done}
        conn = self.conn
        while not (self.done or self.gone or conn.eof):
            await conn._changed()  # pipelined bytes wait in the buffer for their turn
        return {"type": "http.disconnect"}

    async def _body_chunk(self) -> bytes:
        conn, req = self.conn, self.req
        if req.continue_ and not self.started:
            req.continue_ = False
            await conn.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not req.chunked:
            while not conn.buf:
                if conn.eof:
                    raise trio.BrokenResourceError("the client left mid-body")
                await conn._fill()
            n = min(req.body_left, len(conn.buf))
            chunk = bytes(conn.buf[:n])
            del conn.buf[:n]
            req.body_left -= n
            self.body_done = req.body_left == 0
            return chunk
        while True:  # chunked: a size line, the data, CRLF; size 0 ends it (trailers skipped)
            if req.body_left > 0:
                while len(conn.buf) < 1 and not conn.eof:
                    await conn._fill()
                n = min(req.body_left, len(conn.buf))
                if n == 0:
                    raise trio.BrokenResourceError("the client left mid-body")
                chunk = bytes(conn.buf[:n])
                del conn.buf[:n]
                req.body_left -= n
                return chunk
            line = await self._line(skip_crlf=req.body_left == 0 and self._after_chunk)
            size_text = line.split(b";")[0].strip(b" \t")
            if not 0 < len(size_text) <= 16 or size_text.strip(b"0123456789abcdefABCDEF"):
                raise _BadRequest(400, "malformed chunk size")  # int() takes -1, 0x1, 1_0
            size = int(size_text, 16)
            if size == 0:
                while await self._line(skip_crlf=False):  # trailers up to an empty line
                    pass
                self.body_done = True
                return b""
            req.body_left = size
            self._after_chunk = True

    _after_chunk = False
    asked = False
    bad: _BadRequest | None = None

    async def _line(self, *, skip_crlf: bool) -> bytes:
        conn = self.conn
        if skip_crlf:  # the CRLF that ends the previous chunk's data
            while len(conn.buf) < 2:
                if conn.eof:
                    raise trio.BrokenResourceError("the client left mid-body")
                await conn._fill()
            del conn.buf[:2]
            self._after_chunk = False
        while (end := conn.buf.find(b"\r\n")) < 0:
            if conn.eof or len(conn.buf) > _MAX_HEAD:
                raise trio.BrokenResourceError("the client left mid-body")
            await conn._fill()
        line = bytes(conn.buf[:end])
        del conn.buf[: end + 2]
        return line

    # -- send ------------------------------------------------------------------------------

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = int(message["status"])
            for name, value in message.get("headers", ()):
                name = bytes(name).lower()
                if name == b"content-length":
                    self.length = int(value)
                    continue
                if name == b"connection":
                    if b"close" in bytes(value).lower():
                        self.keep = False
                    continue
                elif name == b"transfer-encoding":
                    continue
                self.head.append((name, bytes(value)))
            return
        if kind != "http.response.body":
            return
        if not self.started:
            raise RuntimeError("http.response.body before http.response.start")
        if self.done:
            return
        body = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        out = bytearray()
        if not self.head_sent:
            self.head_sent = True
            if self.length is None:
                if more:
                    self.chunked_out = True
                else:
                    self.length = len(body)
            out += self._head_bytes()
        head_only = self.req.method == "HEAD"
        if self.chunked_out and not head_only:
            if body:
                out += b"%x\r\n%s\r\n" % (len(body), body)
            if not more:
                out += b"0\r\n\r\n"
        elif not head_only:
            out += body
        self.sent += 0 if head_only else len(body)
        if not more:
            self.done = True
            self._log()  # before the last bytes leave: a client that has its answer sees the line
        if self.gone:
            return
        try:
            await self.conn.stream.send_all(out)
        except _GONE:
            self.gone = True
            self.keep = False

    head_sent = False

    def _log(self) -> None:
        log = self.conn.srv.access_log
        if log is not None:
            req = self.req
            log.info(
                '%s "%s %s %s" %s %s %.6fs',
                self.conn.client[0],
                req.method,
                req.target,
                req.version,
                self.status,
                self.sent,
                time.perf_counter() - self.t0,
            )

    def _head_bytes(self) -> bytes:
        srv = self.conn.srv
        if srv.draining or not self.body_done:  # unread body: the next request can't be found
            self.keep = False
        parts = [b"HTTP/1.1 %d %s\r\n" % (self.status, _PHRASES.get(self.status, b""))]
        parts += [b"%s: %s\r\n" % kv for kv in self.head]
        if self.length is not None:
            parts.append(b"content-length: %d\r\n" % self.length)
        elif self.chunked_out:
            parts.append(b"transfer-encoding: chunked\r\n")
        if not self.keep:
            parts.append(b"connection: close\r\n")
        parts.append(b"date: %s\r\n\r\n" % _date())
        return b"".join(parts)


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
