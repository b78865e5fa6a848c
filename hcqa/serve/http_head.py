"""The request head for :mod:`hcqa.serve.http`: parsing and checking it, and what the
server's two halves share on the wire.

Theory of operation
-------------------
The request loop (:mod:`hcqa.serve.http`) gathers the head (request line and headers, at
most 64 KiB) from the connection's buffer and :meth:`_Request.parse` checks it: a malformed
line, a header folded over lines, both ``Content-Length`` and ``Transfer-Encoding``, a
length that is not a number, a target that is not a path: ``400`` (:class:`_BadRequest`)
and the connection closes. While a head is still incomplete, :func:`_check_partial_head`
refuses one that can never end well (a bare LF, a request line without a version) at once
rather than leaving it to the head timeout.

Also here, for the connection and the exchange (:mod:`hcqa.serve.http_exchange`) alike: the
status phrases, the ``Date`` header's value (formatted once a second) and the exceptions a
client that left makes a send or a read raise.
"""

from __future__ import annotations

import email.utils
import re
import time
from http import HTTPStatus
from urllib.parse import unquote

import trio

_MAX_HEAD = 1 << 16
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
                if (
                    not value.isdigit()
                    or len(value) > 18  # int() refuses past 4300 digits; no body is this large
                    or (length is not None and value != length)
                ):
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
