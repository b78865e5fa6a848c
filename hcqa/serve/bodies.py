"""Request bodies for ``hcqa.serve``: read with bounds, decoded off the event loop.

Theory of operation
-------------------
Every protocol the server speaks reads its bodies here, so each gets the same limits:

- :func:`read_body` reads a whole body, bounded in size (``max_body``: 413, refused from
  ``Content-Length`` before anything is read, or as soon as a chunked body passes it) and
  in time (``body_timeout``: 408, measured from the request's headers to the body's last
  byte, so a client that trickles its body holds a connection for a bounded time and never
  an admission slot -- a request is admitted only once its body has arrived). A client that
  goes away mid-body raises :class:`ClientGone`: not a server error, one debug line. Under
  hcqa's own server a body that has all arrived is taken at once (the ``hcqa.body`` scope
  extension), without the timeout (a cancel scope a request) it no longer needs.
- :func:`loads_json` is ``json.loads`` in bounded pieces. CPython's JSON scanner and
  ``json.dumps`` hold the GIL for a whole call: parsing an 840 KB batch in one call, even in
  a worker thread, stalls the event loop for as long as the call takes. Here the structure
  (objects, lists of lists) is walked in Python and only runs of numbers -- a list of
  numbers, cut at commas into pieces of at most :data:`PIECE` characters -- and scalars go
  to the C scanner, so between pieces the loop gets the GIL back within the interpreter's
  switch interval. :func:`dumps_array` writes an array's JSON text the same way.
- :func:`inflate` undoes a request's ``Content-Encoding`` (``gzip`` -- every member of it,
  as ``gzip -d`` reads a file of several --, ``deflate``, ``identity``; anything else 415),
  bounded by the same ``max_body`` once decompressed (a gzip bomb is 413 after at most
  ``max_body`` bytes of output, never decompressed whole).
- :func:`off_loop` runs such a function in a worker thread, one at a time per app (more
  threads would only compete for the GIL with the loop).

Numbers that overflow a double (``1e309``) are refused by :func:`loads_json` instead of
becoming infinity; ``NaN`` and ``Infinity`` are refused as they are by ``json.loads`` here.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import logging
import math
import re
import zlib
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
from starlette.requests import ClientDisconnect, Request

from hcqa.serve.http import BODY

__all__ = [
    "PIECE",
    "ClientGone",
    "InputError",
    "Limits",
    "as_array",
    "dumps_array",
    "inflate",
    "loads_json",
    "off_loop",
    "read_body",
]

PIECE = 1 << 15  # characters of JSON text handed to the C scanner at once
MAX_NESTING = 64  # JSON deeper than this is not inputs
log = logging.getLogger("hcqa.serve")
T = TypeVar("T")


class InputError(Exception):
    """A request that can't be used: ``status`` (400, 408, 413, 503) and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """The client went away before its request could be answered: nobody to answer."""


class Limits(Protocol):
    """What :func:`read_body` reads from the app's state (:class:`hcqa.serve.metrics.State`)."""

    @property
    def max_body(self) -> int: ...  # bytes

    body_timeout: float  # seconds
    receiving: int  # bodies being read now (read_body counts itself in)


async def read_body(request: Request, limits: Limits) -> bytes:
    """The request's whole body: at most ``limits.max_body`` bytes (413) within
    ``limits.body_timeout`` seconds (408).

    Raises :class:`InputError` for those, and :class:`ClientGone` when the client leaves
    before the last byte."""
    limits.receiving += 1
    try:
        return await _read(request, limits.max_body, limits.body_timeout)
    finally:
        limits.receiving -= 1


async def _read(request: Request, limit: int, timeout: float) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise InputError(413, f"body larger than {limit} bytes (got {int(declared)} bytes)")
    queued = request.scope["extensions"].get(BODY) if "extensions" in request.scope else None
    body: bytes | None = None if queued is None else queued()
    if body is not None:  # hcqa's server had it all: nothing to wait for, nor to time
        if len(body) > limit:
            raise InputError(413, f"body larger than {limit} bytes")
        return body
    chunks: list[bytes] = []
    size = 0
    with anyio.move_on_after(timeout) as scope:
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise InputError(413, f"body larger than {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            client = request.client
            log.debug(
                "%s left after %d of %s bytes of its body",
                f"{client.host}:{client.port}" if client else "a client",
                size,
                declared or "?",
            )
            raise ClientGone from None
    if scope.cancelled_caught:
        of = f" of {declared}" if declared.isdigit() else ""
        raise InputError(
            408, f"body must arrive within {timeout:g} s (got {size}{of} bytes in that time)"
        )
    return b"".join(chunks)


async def off_loop(limiter: anyio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread under ``limiter``; cancelling it abandons the thread."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=True)


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` decompressed per its ``Content-Encoding`` (``gzip``, ``deflate`` -- zlib data,
    what tritonclient sends -- or ``identity``), refused past ``limit`` bytes (413)."""
    kind = encoding.strip().lower()
    if kind in ("", "identity"):
        return body
    if kind not in ("gzip", "deflate"):
        raise InputError(
            415, f"Content-Encoding must be gzip, deflate or identity (got {encoding[:40]!r})"
        )
    wbits = 16 + zlib.MAX_WBITS if kind == "gzip" else zlib.MAX_WBITS
    out: list[bytes] = []
    size = 0
    rest = body
    while True:  # one gzip member (or the one zlib stream) a turn
        d = zlib.decompressobj(wbits)
        try:
            piece = d.decompress(rest, limit - size + 1)
        except zlib.error as exc:
            raise InputError(400, f"the body is not {kind} data ({exc})") from None
        size += len(piece)
        if size > limit:
            raise InputError(413, f"body larger than {limit} bytes once decompressed")
        out.append(piece)
        if not d.eof:
            raise InputError(400, f"the {kind} body ends early")
        rest = d.unused_data
        if kind == "deflate" and rest:
            raise InputError(400, f"the deflate body has {len(rest)} bytes after its end")
        if not rest.strip(b"\0"):  # the end (gzip readers allow zero padding after it)
            return b"".join(out)


# -- JSON in pieces ---------------------------------------------------------------------------


def _refuse_constant(name: str) -> float:
    raise InputError(400, f"numbers must be finite (got {name})")


_decoder = json.JSONDecoder(parse_constant=_refuse_constant)
_make_scanner: Any = json.scanner.make_scanner
_scan_once: Callable[[str, int], tuple[Any, int]] = _make_scanner(_decoder)
_scanstring: Callable[[str, int], tuple[str, int]] = getattr(json.decoder, "scanstring")  # noqa: B009
_WS = re.compile(r"[ \t\n\r]*")
_NUMBER_RUN = re.compile(r"[0-9eE+\-. \t\n\r,]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def _not_json(msg: str, text: str, pos: int) -> InputError:
    return InputError(400, f"body is not JSON ({json.JSONDecodeError(msg, text, pos)})")


def _numbers(text: str, start: int, end: int) -> list[Any]:
    """The numbers of ``text[start:end]`` (a list's contents: numbers and commas only),
    parsed in pieces of at most PIECE characters cut at commas."""
    out: list[Any] = []
    if not text[start:end].strip():
        return out
    pos = start
    while pos <= end:
        cut = end if end - pos <= PIECE else text.rfind(",", pos, pos + PIECE)
        if cut <= pos:  # no comma in a whole piece: one very long number (or garbage)
            cut = text.find(",", pos + 1, end)
            cut = end if cut < 0 else cut
        piece = text[pos:cut]
        try:
            values = json.loads(f"[{piece}]")
        except json.JSONDecodeError as exc:
            raise _not_json(exc.msg, text, pos + max(exc.pos - 1, 0)) from None
        except ValueError as exc:  # an integer with more digits than Python converts
            raise InputError(400, f"body holds a number it can't use ({exc})") from None
        if not values:
            raise _not_json("Expecting value", text, pos)
        if max(values) == math.inf or min(values) == -math.inf:  # 1e309 parses as inf
            bad = next(m for m in _NUMBER.finditer(piece) if math.isinf(float(m.group())))
            raise _too_large(bad.group(), pos + bad.start())
        out.extend(values)
        pos = cut + 1
    return out


def _too_large(literal: str, pos: int) -> InputError:
    shown = literal if len(literal) <= 24 else f"{literal[:12]}...{literal[-8:]}"
    return InputError(
        400, f"numbers must fit in a 64-bit float (got {shown} at char {pos}, which does not)"
    )


def _leaf_end(text: str, pos: int) -> int:
    """Where the run of number characters from ``pos`` ends (scanned PIECE at a time)."""
    n = len(text)
    while True:
        stop = min(n, pos + PIECE)
        m = _NUMBER_RUN.match(text, pos, stop)
        assert m is not None  # the pattern matches the empty string
        pos = m.end()
        if pos < stop or stop == n:
            return pos


def loads_json(body: bytes | str) -> Any:
    """``json.loads(body)`` in bounded pieces (see the module's notes); InputError 400 for a
    body that is not JSON, is nested deeper than MAX_NESTING, or holds a non-finite number."""
    if isinstance(body, bytes):
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(400, "body is not JSON (not UTF-8 text)") from None
    else:
        text = body
    n = len(text)
    stack: list[list[Any] | _Object] = []  # the open containers, outermost first
    pos = _WS.match(text, 0).end()  # type: ignore[union-attr]
    while True:
        # -- a value starts at pos --
        if pos >= n:
            raise _not_json("Expecting value", text, pos)
        c = text[pos]
        value: Any
        if c == "[":
            end = _leaf_end(text, pos + 1)
            if end < n and text[end] == "]":  # a list of numbers: the C scanner, in pieces
                value = _numbers(text, pos + 1, end)
                pos = end + 1
            else:
                if len(stack) >= MAX_NESTING:
                    raise InputError(400, "body is JSON nested too deeply to be inputs")
                pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
                if pos < n and text[pos] == "]":
                    value, pos = [], pos + 1
                else:
                    stack.append([])
                    continue
        elif c == "{":
            if len(stack) >= MAX_NESTING:
                raise InputError(400, "body is JSON nested too deeply to be inputs")
            pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
            if pos < n and text[pos] == "}":
                value, pos = {}, pos + 1
            else:
                key, pos = _key(text, pos)
                stack.append(_Object(key))
                continue
        else:
            try:
                value, end = _scan_once(text, pos)
            except StopIteration as stop:
                raise _not_json("Expecting value", text, stop.value) from None
            except json.JSONDecodeError as exc:
                raise _not_json(exc.msg, text, exc.pos) from None
            except ValueError as exc:  # an integer with more digits than Python converts
                raise InputError(400, f"body holds a number it can't use ({exc})") from None
            if type(value) is float and math.isinf(value):
                raise _too_large(text[pos:end], pos)
            pos = end
        # -- a value ended at pos: put it in its container, close what ends here --
        while True:
            if not stack:
                pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
                if pos != n:
                    raise _not_json("Extra data", text, pos)
                return value
            top = stack[-1]
            pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
            c = text[pos] if pos < n else ""
            if isinstance(top, list):
                top.append(value)
                if c == ",":
                    pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
                    break
                if c != "]":
                    raise _not_json("Expecting ',' delimiter", text, pos)
            else:
                top.doc[top.key] = value
                if c == ",":
                    pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
                    top.key, pos = _key(text, pos)
                    break
                if c != "}":
                    raise _not_json("Expecting ',' delimiter", text, pos)
            stack.pop()
            value = top if isinstance(top, list) else top.doc
            pos += 1


class _Object:
    """An object being parsed: what it holds so far and the key whose value comes next."""

    __slots__ = ("doc", "key")

    def __init__(self, key: str) -> None:
        self.doc: dict[str, Any] = {}
        self.key = key


def _key(text: str, pos: int) -> tuple[str, int]:
    """An object's key at ``pos`` and the position after its ``:`` and whitespace."""
    if pos >= len(text) or text[pos] != '"':
        raise _not_json("Expecting property name enclosed in double quotes", text, pos)
    try:
        key, pos = _scanstring(text, pos + 1)
    except json.JSONDecodeError as exc:
        raise _not_json(exc.msg, text, exc.pos) from None
    pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
    if pos >= len(text) or text[pos] != ":":
        raise _not_json("Expecting ':' delimiter", text, pos)
    return key, _WS.match(text, pos + 1).end()  # type: ignore[union-attr]


def dumps_array(a: npt.NDArray[Any]) -> bytes:
    """``json.dumps(a.tolist())`` built in pieces of about 4096 numbers (see the notes)."""
    if a.ndim == 0 or a.size <= 4096:
        return json.dumps(a.tolist()).encode()
    row = math.prod(a.shape[1:])
    if row > 4096:
        return b"[" + b", ".join(dumps_array(r) for r in a) + b"]"
    step = max(1, 4096 // max(row, 1))
    parts = [json.dumps(a[i : i + step].tolist())[1:-1] for i in range(0, len(a), step)]
    return f"[{', '.join(parts)}]".encode()


def as_array(value: Any, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``np.array(value, dtype)`` for checked nested lists, converted a sample at a time."""
    if not isinstance(value, list) or len(value) <= 1:
        with np.errstate(over="ignore"):
            return np.array(value, dtype=dtype)
    with np.errstate(over="ignore"):  # the caller checks that the numbers fit
        first = np.array(value[0], dtype=dtype)
        x = np.empty((len(value), *first.shape), dtype=dtype)
        x[0] = first
        for i in range(1, len(value)):
            x[i] = value[i]
    return x
