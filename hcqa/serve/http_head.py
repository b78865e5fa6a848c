"""The request side of the wire for :mod:`hcqa.serve.http`: bytes in, checked requests out.

Theory of operation
-------------------
Each connection has one :class:`_Parser`. The connection's reader hands it every byte it
receives; llhttp (the HTTP parser of Node.js, through ``httptools``) reads them and the
parser queues what they are, in order, in :attr:`_Parser.events`: a :class:`_Request` when
a head is complete and checked, ``bytes`` for each piece of body (``Content-Length`` or
chunked: llhttp takes the framing apart), :data:`END` when a message ends, and a
:class:`_BadRequest` when the bytes can't be a request -- after which nothing more is
parsed. The request loop takes the heads, the exchange (:mod:`hcqa.serve.http_exchange`)
the body pieces; pipelined requests wait in the queue for their turn.

llhttp is strict about syntax: CRLF line ends (a bare LF, a bare CR or a NUL is refused),
token characters in names, no folded lines, digits in ``Content-Length`` and no two of them,
hex chunk sizes that fit 64 bits, the CRLF after each chunk's data, no ``Transfer-Encoding``
with ``Content-Length``. On top of it, :meth:`_Parser.on_headers_complete` refuses what a
front proxy and this server could read two ways: more than one ``Transfer-Encoding`` line, or
one that is not exactly ``chunked``; ``Transfer-Encoding`` on HTTP/1.0; no ``Host`` or two
on HTTP/1.1 (two on 1.0); an upgrade request with a body (llhttp would not read it). Each
is ``400`` and the connection closes; another version than 1.0 and 1.1 is ``505``. Targets
are paths or absolute URLs (``http://host/path``, whose path is used); others are ``400``.

Costs stay linear in the bytes: while a head arrives, the parser is fed whole lines only
(the bytes of an unfinished line wait in :attr:`_Parser.pending`), so a head trickled in a
byte at a time costs what it costs in one piece. Limits: a head over 64 KiB is ``431``; more
than 16 KiB of chunk framing in a row (a chunk-size line with its extensions, or the
trailers) is ``400``. The reader stops reading while :attr:`_Parser.backlog` (queued heads
and body bytes) is past its limit, so a client can't queue without bound.

Also here, for the connection and the exchange alike: the status phrases, the ``Date``
header's value (formatted once a second) and the exceptions a client that left makes a
send or a read raise.
"""

from __future__ import annotations

import email.utils
import re
import time
from collections import deque
from http import HTTPStatus
from urllib.parse import unquote

import httptools
import trio

_MAX_HEAD = 1 << 16
_MAX_FRAMING = 1 << 14  # bytes of chunk-size lines, extensions or trailers in a row
_TOO_MUCH_FRAMING = f"a chunk-size line or the trailers passed {_MAX_FRAMING} bytes"
_SLICE = 1 << 12  # a chunked body is fed this many bytes at a time (counting its framing)
_PHRASES = {s.value: s.phrase.encode() for s in HTTPStatus}
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
_ABSOLUTE = re.compile(rb"[hH][tT][tT][pP][sS]?://[^/?#]*")


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Stop(Exception):
    """Raised in a parser callback to stop llhttp; the reason is in ``_Parser.fault``."""


class _End:
    """The type of :data:`END`."""


END = _End()  # the current message's body has ended

_date_cache: tuple[int, bytes] = (0, b"")


def _date() -> bytes:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True).encode())
    return _date_cache[1]


def _shown(data: bytes, limit: int = 40) -> str:
    text = repr(data[:limit])[2:-1]
    return text + ("..." if len(data) > limit else "")


class _Request:
    __slots__ = (
        "chunked",
        "continue_",
        "headers",
        "keep",
        "method",
        "path",
        "query",
        "raw_path",
        "size",
        "target",
        "version",
    )

    method: str
    version: str
    target: str
    raw_path: bytes
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    chunked: bool
    continue_: bool  # answer "100 Continue" when the app first asks for the body
    keep: bool
    size: int  # bytes of the head (counted in the parser's backlog while queued)


class _Parser:
    """One connection's requests, parsed as its bytes arrive (see the module's notes)."""

    def __init__(self) -> None:
        self.events: deque[_Request | bytes | bytearray | _End | _BadRequest] = deque()
        self.backlog = 0  # bytes of heads and bodies queued in events
        self.pending = bytearray()  # an unfinished line of a head, not yet fed
        self.in_head = True  # between messages or inside a head (not in a body)
        self.began = False  # a head has begun and is not complete
        self.failed = False  # a _BadRequest is queued: nothing more is parsed
        self.fault: _BadRequest | None = None  # why a callback stopped llhttp
        self._llhttp = httptools.HttpRequestParser(self)
        self._url: list[bytes] = []
        self._headers: list[tuple[bytes, bytes]] = []
        self._size = 0  # bytes of the head being parsed
        self._body = 0  # body bytes parsed, in all
        self._framing = 0  # >= bytes of framing fed since the last chunk data (< _SLICE more)
        self._chunked = False  # the body being parsed is chunked
        self._crlf_last = False  # the last head bytes fed ended with CRLF
        self._last: _Request | None = None

    def started(self) -> bool:
        """Whether a request has begun to arrive (or is queued)."""
        return bool(self.events or self.pending or self.began)

    def feed(self, data: bytes) -> None:
        """Parse ``data``, the next bytes from the client."""
        if self.failed:
            return
        if self.pending:  # the rest of an unfinished line of a head
            if data.find(b"\n") < 0:
                self.pending += data
                self._check_pending()
                return
            data = bytes(self.pending) + data
            self.pending.clear()
        pos, n = 0, len(data)
        while pos < n and not self.failed:
            if not self.in_head:
                pos = self._feed_body(data, pos)
                continue
            last = data.rfind(b"\n", pos) + 1  # a head is fed whole lines only
            if last == 0:
                self.pending += data[pos:]
                self._check_pending()
                return
            if not self.began:
                self._check_request_line(data, pos)
                if self.failed:
                    return
            end = data.find(b"\r\n\r\n", pos, last)
            if end < 0 and self._crlf_last and data.startswith(b"\r\n", pos):
                end = pos - 2  # the head's last CRLF came alone
            stop = last if end < 0 else end + 4  # what follows the head: body or next request
            self._execute(data[pos:stop])
            self._crlf_last = end < 0 and data.endswith(b"\r\n", pos, stop)
            pos = stop

    def _check_pending(self) -> None:
        if len(self.pending) > _MAX_HEAD and not self.failed:
            self.fail(_BadRequest(431, "request head larger than 64 KiB"))

    def _feed_body(self, data: bytes, pos: int) -> int:
        """Feed ``data[pos:]``, which begins inside a body, up to the body's end; return where
        the feeding stopped. A chunked body goes in slices of :data:`_SLICE` bytes, to count
        its framing (llhttp does not say where in a feed a chunk begins)."""
        n = len(data)
        if not self._chunked:  # all data: nothing to count
            self._execute(data[pos:] if pos else data)
            return n
        while pos < n and not (self.in_head or self.failed):
            # self._framing >= the framing bytes since the last boundary; a slice no longer
            # than what the limit leaves passes it, if all framing, before anything ends
            piece = data[pos : pos + min(_SLICE, _MAX_FRAMING + 1 - self._framing)]
            pos += len(piece)
            body = self._body
            self._execute(piece)
            if self.in_head or self.failed:
                break
            data_bytes = self._body - body  # a chunk's data: its size line and CRLF came first
            framing = len(piece) - data_bytes  # bytes of this slice that were no data
            self._framing = framing if data_bytes else self._framing + framing
            if self._framing > _MAX_FRAMING:  # a chunk-size line or trailers without end
                self.fail(_BadRequest(400, _TOO_MUCH_FRAMING))
        return pos

    def _check_request_line(self, data: bytes, pos: int) -> None:
        """Refuse at once a request line without ``HTTP/x.y`` (HTTP/0.9: the client waits
        for an answer, not a 408); llhttp checks the rest of it."""
        n = len(data)
        while pos < n and data[pos] in b"\r\n":  # llhttp skips empty lines first
            pos += 1
        end = data.find(b"\n", pos)
        if end > pos:
            line = data[pos:end].rstrip(b"\r")
            if line[-9:-3] != b" HTTP/":
                self.fail(_BadRequest(400, f"malformed request line ({_shown(line)})"))

    def _execute(self, data: bytes) -> None:
        try:
            self._llhttp.feed_data(data)
        except httptools.HttpParserUpgrade:  # answer the request, then close: not upgraded
            if self._last is not None:
                self._last.keep = False
            self.failed = True  # what follows is in another protocol: not parsed
        except httptools.HttpParserCallbackError as exc:
            if self.fault is None:  # a bug in a callback, not the client's bytes
                raise exc.__context__ or exc  # noqa: B904
            self.fail(self.fault)
        except httptools.HttpParserError as exc:
            self.fail(_BadRequest(400, f"malformed request ({exc})"))

    def fail(self, fault: _BadRequest) -> None:
        """Queue ``fault`` and parse nothing more."""
        if self.failed:
            return
        self.failed = True
        self.events.append(fault)

    def _stop(self, status: int, message: str) -> None:
        self.fault = _BadRequest(status, message)
        raise _Stop(message)

    # -- llhttp's callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.began = True
        self._url = []
        self._headers = []
        self._size = 0

    def on_url(self, part: bytes) -> None:
        self._url.append(part)
        self._grow(len(part))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:
            self._headers.append((name.lower(), value))
            self._grow(len(name) + len(value) + 4)
        # else a trailer: dropped (its bytes count as framing: see _feed_body)

    def _grow(self, n: int) -> None:
        self._size += n
        if self._size > _MAX_HEAD:
            self._stop(431, "request head larger than 64 KiB")

    def on_headers_complete(self) -> None:
        req = self._request()
        self._chunked = req.chunked
        self._framing = 0
        self.in_head = self.began = False
        self._last = req
        self.events.append(req)
        self.backlog += req.size

    def on_body(self, data: bytes) -> None:
        events = self.events
        last = events[-1] if events else None
        if isinstance(last, bytearray):  # tiny chunks: one growing piece, not an object each
            last += data
        elif isinstance(last, bytes):
            events[-1] = bytearray(last) + data
        else:
            events.append(data)
        self.backlog += len(data)
        self._body += len(data)

    def on_message_complete(self) -> None:
        self.events.append(END)
        self.in_head = True

    # -- the checks on top of llhttp's -----------------------------------------------------

    def _request(self) -> _Request:
        llhttp = self._llhttp
        r = _Request()
        r.version = llhttp.get_http_version()
        if r.version not in ("1.0", "1.1"):
            self._stop(505, f"HTTP version not supported (got HTTP/{r.version}; 1.0 or 1.1)")
        r.method = llhttp.get_method().decode("ascii")
        target = b"".join(self._url)
        r.target = target.decode("latin-1")
        if not target.startswith(b"/"):
            absolute = _ABSOLUTE.match(target)
            if absolute is None:
                self._stop(
                    400, f"the request target must be a path or an absolute URL (got {r.target!r})"
                )
                raise AssertionError  # not reached: for the type checker
            target = target[absolute.end() :]
            target = target if target.startswith(b"/") else b"/" + target
        r.raw_path, _, r.query = target.partition(b"?")
        r.path = unquote(r.raw_path.decode("latin-1"))
        r.headers = self._headers
        r.size = self._size
        te: list[bytes] = []
        length = b""
        hosts = 0
        connection = b""
        expect = b""
        for name, value in r.headers:
            if name == b"transfer-encoding":
                te.append(value)
            elif name == b"content-length":
                length = value  # llhttp refused a second one, and anything but digits
            elif name == b"host":
                hosts += 1
            elif name == b"connection":
                connection += b"," + value.lower()
            elif name == b"expect":
                expect = value.lower()
        if te:
            if len(te) > 1 or te[0].strip().lower() != b"chunked":
                shown = ", ".join(_shown(v) for v in te)
                self._stop(400, f"Transfer-Encoding must be one line 'chunked' (got {shown})")
            if r.version == "1.0":
                self._stop(400, "Transfer-Encoding on HTTP/1.0 (RFC 9112: can't be framed)")
        if hosts > 1 or (hosts == 0 and r.version == "1.1"):
            self._stop(400, f"an HTTP/1.1 request needs one Host header (got {hosts})")
        r.chunked = bool(te)
        body = r.chunked or length.strip(b" \t0") != b""
        if llhttp.should_upgrade() and body:
            self._stop(400, "an Upgrade request must not have a body (upgrades are not served)")
        if r.version == "1.1":
            r.keep = b"close" not in connection
        else:
            r.keep = b"keep-alive" in connection
        r.continue_ = body and r.version == "1.1" and expect == b"100-continue"
        return r
