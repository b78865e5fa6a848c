"""One request's ASGI ``receive`` and ``send`` for :mod:`hcqa.serve.http`.

Theory of operation
-------------------
The app's ``receive`` hands out the body from the connection's buffer (``Content-Length``
or chunked); once the body is read, a ``receive`` waits for the reader to see EOF and says
``http.disconnect`` -- bytes that arrive meanwhile are the next pipelined request and stay
in the buffer. A malformed chunked body is answered ``400`` by the host, not the app (to
the app the client is gone).

The app's ``send`` collects the response head; the head and a body that is complete in one
message (what Starlette's ``Response`` sends) leave in one ``send_all`` -- one syscall per
response. A streamed body goes out chunked unless the app gave a length. A response says
``Connection: close`` while the server drains, or when the app left part of the body unread
(the next request can't be found).

A client that leaves makes ``send`` a no-op and ``receive`` say ``http.disconnect``; the
``hcqa.disconnect`` scope extension (:meth:`_Exchange.on_disconnect`) calls the app back
when that happens before its response is complete.

The exchange knows its connection only by what it uses of it (:class:`_Conn`), so this
module does not import :mod:`hcqa.serve.http`, which builds an exchange per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import trio

from hcqa.serve.http_head import _GONE, _MAX_HEAD, _PHRASES, _BadRequest, _date, _Request


class _Host(Protocol):
    """What an exchange reads of the server (``hcqa.serve.http._Server``)."""

    @property
    def draining(self) -> bool: ...
    @property
    def access_log(self) -> logging.Logger | None: ...


class _Conn(Protocol):
    """What an exchange uses of its connection (``hcqa.serve.http._Connection``)."""

    @property
    def srv(self) -> _Host: ...
    @property
    def stream(self) -> trio.SocketStream: ...
    @property
    def client(self) -> tuple[str, int]: ...
    @property
    def buf(self) -> bytearray: ...
    @property
    def eof(self) -> bool: ...
    async def _changed(self) -> None: ...
    async def _fill(self) -> None: ...


class _Exchange:
    """One request's ``receive`` and ``send``."""

    def __init__(self, conn: _Conn, req: _Request, t0: float) -> None:
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
