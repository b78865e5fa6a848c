"""One request's ASGI ``receive`` and ``send`` for :mod:`hcqa.serve.http`.

Theory of operation
-------------------
The app's ``receive`` hands out the body as the connection's parser queued it (pieces of a
``Content-Length`` or chunked body, :mod:`hcqa.serve.http_head`), all the pieces queued at
once in one message; once the body is read, a ``receive`` waits for the reader to see EOF
and says ``http.disconnect`` -- requests that arrive meanwhile are pipelined and stay queued
for their turn. A malformed chunked body is answered ``400`` by the host, not the app (to the
app the client is gone). ``100 Continue`` goes to an HTTP/1.1 client that asked for it, when
the app first asks for a body that has not begun to arrive.

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

from hcqa.serve.http_head import _GONE, _PHRASES, END, _BadRequest, _date, _Parser, _Request


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
    def parser(self) -> _Parser: ...
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
        events = conn.parser.events
        self.body_done = bool(events) and events[0] is END  # no body: its end is queued already
        if self.body_done:
            events.popleft()
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

    def queued_body(self) -> bytes | None:
        """The ``hcqa.body`` extension: the whole body, read now, if all of it has arrived and
        the app has not begun to read it; else None (read it with ``receive``). It spares an
        app the timeout it puts around a body that may not have come yet."""
        if self.asked:
            return None
        events = self.conn.parser.events
        n = 0
        if not self.body_done:
            for event in events:  # body pieces, then END (a fault or a missing end: None)
                if event is END:
                    break
                if not isinstance(event, bytes | bytearray):
                    return None
                n += 1
            else:
                return None
        pieces = [events.popleft() for _ in range(n)]
        if not self.body_done:
            events.popleft()  # END
        self.asked = self.body_done = True
        self.req.continue_ = False  # the body came: no 100 Continue to send
        first = pieces[0] if len(pieces) == 1 else None
        body = first if type(first) is bytes else b"".join(pieces)  # type: ignore[arg-type]
        self.conn.parser.backlog -= len(body)
        return body

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
            await conn._changed()  # pipelined requests wait queued for their turn
        return {"type": "http.disconnect"}

    async def _body_chunk(self) -> bytes:
        conn, req = self.conn, self.req
        parser = conn.parser
        events = parser.events
        if req.continue_:
            req.continue_ = False
            if not self.started and not events:  # no byte of the body has come yet
                await conn.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
        while not events:
            if conn.eof:
                raise trio.BrokenResourceError("the client left mid-body")
            await conn._fill()
        pieces: list[bytes | bytearray] = []
        while events and isinstance(events[0], bytes | bytearray):  # all queued, one message
            pieces.append(events.popleft())  # type: ignore[arg-type]
        first = pieces[0] if len(pieces) == 1 else None
        chunk = first if type(first) is bytes else b"".join(pieces)
        parser.backlog -= len(chunk)
        if events and events[0] is END:
            events.popleft()
            self.body_done = True
        elif events and not pieces:  # the body is malformed: the parser queued why
            fault = events.popleft()
            assert isinstance(fault, _BadRequest), fault
            raise fault
        return chunk

    asked = False
    bad: _BadRequest | None = None

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
