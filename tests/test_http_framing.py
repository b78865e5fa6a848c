"""The HTTP border under attack, as raw bytes over a socket: request smuggling, limits, and
requests that must not take the server down. Each case asserts the status, that the
connection is closed after it, that the server still answers a fresh connection, and that a
connection opened before it (a request in flight) is answered too: no case cuts another.

The same cases run against hypercorn (``serve(http="hypercorn")``'s host); where it answers
otherwise, the case says so in ``HYPERCORN`` (recorded, not fixed: it is not hcqa's parser).
What made hypercorn raise out of a connection (``BREAKERS``) must end that connection only
(:mod:`hcqa.serve.hypercorn_worker`'s guard).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from hcqa.serve import http as hcqa_http
from hcqa.serve.http import serve_http
from hcqa.serve.http_head import END, _BadRequest, _Parser, _Request

pytest.importorskip("hypercorn")


class Echo:
    """A bare ASGI app: answers 200 with the body it read (or raises on ``/boom``)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # hypercorn asks; nothing to set up
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            body += msg["body"]
            if not msg["more_body"]:
                break
        out = b"%s %s %s" % (scope["method"].encode(), scope["raw_path"], body)
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(out))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})


def _hypercorn_start(**options: Any) -> Any:
    from hcqa.serve.server import _hypercorn

    # keep-alive 1 s: where hypercorn answers an error and keeps the connection, the case
    # waits for this close (5 s made its ten such cases 50 s of the suite)
    options = {"keep_alive_timeout": 1, **options}
    return _hypercorn("127.0.0.1", 0, 1.0, None, "critical", options)


@asynccontextmanager
async def host(kind: str, **options: Any) -> AsyncIterator[int]:
    """Serve :class:`Echo` with hcqa's HTTP server or hypercorn (``options``: its ``Config``'s
    attributes); yield the port."""
    start: Any = (
        partial(serve_http, host="127.0.0.1", port=0, **options)
        if kind == "hcqa"
        else _hypercorn_start(**options)
    )
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(start, Echo(), shutdown_trigger=trio.sleep_forever))
        yield int(binds[0].rsplit(":", 1)[1])
        nursery.cancel_scope.cancel()


async def exchange(
    port: int, data: bytes, *, pieces: int = 0, wait: float = 10
) -> tuple[list[int], bool]:
    """Send ``data`` (in ``pieces`` bytes at a time if given), then read until the server
    closes: (the statuses of the responses read, whether the server closed the connection
    within ``wait`` seconds)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    closed = False
    async with stream:
        try:
            step = pieces or len(data) or 1
            for i in range(0, len(data), step):
                await stream.send_all(data[i : i + step])
        except trio.BrokenResourceError:
            pass  # the server closed while we sent: read what it answered
        with trio.move_on_after(wait):
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:  # reset: closed too
                    chunk = b""
                if not chunk:
                    closed = True
                    break
                got += chunk
    statuses = [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3}) ", got)]
    return statuses, closed


async def still_answers(port: int) -> None:
    statuses, _ = await exchange(port, b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert statuses == [200], statuses


async def answer(stream: trio.SocketStream) -> bytes:
    """Read one ``200`` response with a ``Content-Length`` from ``stream``: its body."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before an answer (got {got!r})"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    assert length is not None, head
    while len(body) < int(length[1]):
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed in an answer (got {got!r})"
        body += chunk
    return body


async def in_flight(port: int) -> trio.SocketStream:
    """A connection with a request in flight: its head and half its body sent."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
    return stream


async def finish(stream: trio.SocketStream) -> None:
    """Send the rest of :func:`in_flight`'s request: it is answered, the connection whole."""
    async with stream:
        await stream.send_all(b"cd")
        assert await answer(stream) == b"POST /slow abcd"


HOSTS = pytest.mark.parametrize("kind", ["hcqa", "hypercorn"])


# -- one request never ends the server ---------------------------------------------------------


@HOSTS
async def test_a_content_length_of_5000_digits_is_a_400_and_the_server_goes_on(kind: str) -> None:
    async with host(kind) as port:
        head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n"
        statuses, closed = await exchange(port, head)
        assert statuses == [400] and closed
        await still_answers(port)


async def test_an_unexpected_error_stays_in_its_connection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug the checks did not foresee")

    async with host("hcqa") as port:
        with monkeypatch.context() as m:
            m.setattr(_Parser, "_request", broken)
            with caplog.at_level(logging.ERROR, "hcqa.serve.http"):
                statuses, closed = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert statuses == [500] and closed
        assert "a bug the checks did not foresee" in caplog.text
        await still_answers(port)


async def test_an_error_past_the_head_closes_only_its_connection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug while answering")

    async with host("hcqa") as port:
        with monkeypatch.context() as m:
            m.setattr(hcqa_http, "_Exchange", broken)
            with caplog.at_level(logging.ERROR, "hcqa.serve.http"):
                statuses, closed = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert statuses == [] and closed
        assert "a bug while answering" in caplog.text
        await still_answers(port)


# -- framing: each case refused, the connection closed, the server unharmed ----------------------

H = b"Host: x\r\n"
CHUNKED = b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
CASES: dict[str, tuple[bytes, int]] = {
    # chunked framing
    "chunk data not followed by CRLF": (CHUNKED + b"3\r\nabcXX0\r\n\r\n", 400),
    "bare LF after a chunk size": (CHUNKED + b"3\nabc\r\n0\r\n\r\n", 400),
    "bare LF after chunk data": (CHUNKED + b"3\r\nabc\n0\r\n\r\n", 400),
    "chunk size past 64 bits": (CHUNKED + b"f" * 17 + b"\r\na\r\n0\r\n\r\n", 400),
    "chunk size -1": (CHUNKED + b"-1\r\na\r\n0\r\n\r\n", 400),
    "chunk size 0x1": (CHUNKED + b"0x1\r\na\r\n0\r\n\r\n", 400),
    "over-long chunk extension": (CHUNKED + b"1;" + b"e" * 20_000 + b"\r\na\r\n0\r\n\r\n", 400),
    "over-long trailer line": (CHUNKED + b"0\r\nT: " + b"t" * 20_000 + b"\r\n\r\n", 400),
    # which framing: Transfer-Encoding and Content-Length
    "two Transfer-Encoding lines": (
        b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    "Transfer-Encoding gzip, chunked": (
        b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    "Transfer-Encoding gzip": (
        b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
        400,
    ),
    "Transfer-Encoding with Content-Length": (
        b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    "Transfer-Encoding on HTTP/1.0": (
        b"POST /c HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n",
        400,
    ),
    "two Content-Lengths": (
        b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        400,
    ),
    "Content-Length 1, 2": (b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\nab", 400),
    "Content-Length -1": (b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    "Content-Length +1": (b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: +1\r\n\r\na", 400),
    "Content-Length of 5000 digits": (
        b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
        400,
    ),
    "an Upgrade with a body": (
        b"POST /c HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
        b"Content-Length: 3\r\n\r\nabc",
        400,
    ),
    # header bytes
    "NUL in a header value": (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400),
    "NUL in a header name": (b"GET / HTTP/1.1\r\nHost: x\r\nX\x00: ab\r\n\r\n", 400),
    "bare CR in a header value": (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", 400),
    "bare CR in a header name": (b"GET / HTTP/1.1\r\nHost: x\r\nX\r: ab\r\n\r\n", 400),
    "space before the colon": (b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    "a folded header": (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", 400),
    "a bare LF ending the head": (b"GET / HTTP/1.1\r\nHost: x\n\n", 400),
    # Host
    "no Host on HTTP/1.1": (b"GET / HTTP/1.1\r\n\r\n", 400),
    "two Hosts on HTTP/1.1": (b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    "two Hosts on HTTP/1.0": (b"GET / HTTP/1.0\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    # the request line
    "HTTP/0.9": (b"GET /\r\n", 400),
    "HTTP/2.0 in text": (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    "a lower-case method": (b"get / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "a control byte in the target": (b"GET /a\x01b HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "an authority-form target": (b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "an asterisk-form target": (b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    # limits
    "a head past 64 KiB": (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    "a request line past 64 KiB": (b"GET /" + b"a" * 70_000, 431),
}


#: hypercorn (h11) where it answers otherwise than hcqa: (statuses, closed) -- recorded, not
#: fixed. None: no answer, the connection left open (h11 waits for 2**68 bytes of chunk).
HYPERCORN: dict[str, tuple[list[int], bool] | None] = {
    "chunk size past 64 bits": None,
    "over-long chunk extension": ([200], True),  # h11 skips extensions of any length
    "over-long trailer line": ([200], True),  # within h11's 16 KiB? no: trailers unbounded
    "two Transfer-Encoding lines": ([501], True),
    "Transfer-Encoding gzip, chunked": ([501], True),
    "Transfer-Encoding gzip": ([501], True),
    "Transfer-Encoding with Content-Length": ([200], True),  # chunked wins, then it closes
    "Transfer-Encoding on HTTP/1.0": ([200], True),
    "an Upgrade with a body": ([200], True),
    "a folded header": ([200], True),  # obs-fold joined
    "a bare LF ending the head": ([200], True),
    "HTTP/0.9": ([], True),  # closed without an answer
    "HTTP/2.0 in text": ([200], True),
    "a lower-case method": ([200], True),
    "an authority-form target": ([200], True),
    "an asterisk-form target": ([200], True),
}


@pytest.mark.parametrize("case", list(CASES))
@HOSTS
async def test_framing_cases(kind: str, case: str) -> None:
    data, status = CASES[case]
    want: tuple[list[int], bool] | None = ([status], True)
    if kind == "hypercorn":
        want = HYPERCORN.get(case, want)
    async with host(kind) as port:
        slow = await in_flight(port)  # a connection opened before is not cut either
        got = await exchange(port, data, wait=10 if want is not None else 1)
        if want is None:
            assert got[0] == []
        else:
            assert got == want
        await still_answers(port)
        await finish(slow)


# -- what must be accepted ---------------------------------------------------------------------


@HOSTS
async def test_absolute_form_targets_are_served_by_their_path(kind: str) -> None:
    async with host(kind) as port:
        statuses, _ = await exchange(
            port,
            b"GET http://x/a%20b?q=1 HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET HTTP://x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        assert statuses == [200, 200]
    async with host("hcqa") as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET http://x/a%20b?q=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while not got.endswith(b"GET /a%20b "):
                got += await stream.receive_some(65536)


async def test_pipelined_requests_then_garbage_answer_in_order_then_400() -> None:
    async with host("hcqa") as port:
        ok = b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
        chunked = CHUNKED + b"2;x=y\r\nhi\r\n0\r\nT: v\r\n\r\n"
        statuses, closed = await exchange(port, ok + chunked + b"GARBAGE\r\n\r\n" + ok)
        assert statuses == [200, 200, 400] and closed


UPGRADE = (
    b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
FRAME = b"\x81\x85abcd" + bytes(c ^ k for c, k in zip(b"hello", b"abcd" * 2, strict=False))
OK = b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
BEFORE_UPGRADE = {
    "a GET": b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n",
    "a POST and a chunked POST": OK + CHUNKED + b"2\r\nhi\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("pieces", [0, 7])
@pytest.mark.parametrize("before", list(BEFORE_UPGRADE))
async def test_requests_pipelined_before_an_upgrade_are_all_answered(
    before: str, pieces: int
) -> None:
    """A websocket upgrade is not served: the requests received before it are answered in
    order, then the upgrade request itself (as plain HTTP, ``Connection: close``), then the
    connection closes; the frame sent after it is never read as a request.

    hcqa only: hypercorn (0.18, h11) answers the requests before it, then takes the upgrade
    and answers it ``400`` (below: what it must not do beyond that)."""
    data = BEFORE_UPGRADE[before]
    n = data.count(b" HTTP/1.1\r\n")
    async with host("hcqa") as port:
        # closed at once, not after the 5 s keep-alive timeout
        statuses, closed = await exchange(port, data + UPGRADE + FRAME, pieces=pieces, wait=2)
        assert statuses == [200] * (n + 1) and closed
        await still_answers(port)


#: a websocket upgrade with bytes behind it, sent before its answer: each made hypercorn 0.18
#: raise h11's ``LocalProtocolError`` out of the connection, which ended its whole server
BREAKERS = {
    "an upgrade and a frame": UPGRADE + FRAME,
    "a GET, an upgrade and a frame": BEFORE_UPGRADE["a GET"] + UPGRADE + FRAME,
    "two POSTs, an upgrade and garbage": (
        BEFORE_UPGRADE["a POST and a chunked POST"] + UPGRADE + b"GARBAGE\r\n\r\n"
    ),
    "a HEAD, an upgrade and a close frame": (
        b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n" + UPGRADE + b"\x88\x80abcd"
    ),
}


@pytest.mark.parametrize("pieces", [0, 7])
@pytest.mark.parametrize("case", list(BREAKERS))
@HOSTS
async def test_an_upgrade_with_bytes_behind_it_ends_only_its_connection(
    kind: str, case: str, pieces: int
) -> None:
    data = BREAKERS[case]
    n = data.count(b" HTTP/1.1\r\n") - 1  # the requests before the upgrade
    async with host(kind) as port:
        slow = await in_flight(port)
        statuses, closed = await exchange(port, data, pieces=pieces, wait=2)
        assert statuses[:n] == [200] * n and len(statuses) == n + 1 and closed, statuses
        await still_answers(port)
        await finish(slow)


async def test_a_connection_that_breaks_hypercorn_ends_only_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """hypercorn 0.18 raises h11's ``LocalProtocolError`` out of a connection that pipelines a
    request, a websocket upgrade and a frame (whatever the app does with websockets): hcqa's
    worker keeps it in that connection -- logged once, with the peer, and closed -- while a
    connection idle since its last answer, one with a request in flight and a new one are
    all served."""
    async with host("hypercorn", keep_alive_timeout=30) as port:
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await idle.send_all(b"GET /idle HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await answer(idle) == b"GET /idle "
        slow = await in_flight(port)
        with caplog.at_level(logging.ERROR, "hcqa.serve.hypercorn_worker"):
            async with await trio.open_tcp_stream("127.0.0.1", port) as bad:
                ip, client_port = bad.socket.getsockname()[:2]
                peer = f"{ip}:{client_port}"
                await bad.send_all(BEFORE_UPGRADE["a GET"] + UPGRADE + FRAME)
                with trio.fail_after(5):  # closed at once, not at the keep-alive timeout
                    with contextlib.suppress(trio.BrokenResourceError):
                        while await bad.receive_some(65536):
                            pass
        await still_answers(port)
        async with idle:
            await idle.send_all(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await answer(idle) == b"GET /again "
        await finish(slow)
    logged = [r for r in caplog.records if r.name == "hcqa.serve.hypercorn_worker"]
    assert len(logged) == 1 and peer in logged[0].getMessage(), caplog.text
    assert "LocalProtocolError" in caplog.text


def test_the_hypercorn_guard_is_built_only_for_the_versions_it_knows() -> None:
    from hypercorn.trio.run import worker_serve
    from hypercorn.trio.tcp_server import TCPServer

    from hcqa.serve import hypercorn_worker as hw

    assert hw.UNGUARDED is None  # the installed hypercorn is one it knows
    assert hw._unguardable("0.18.0", worker_serve, TCPServer) is None
    for version in ("0.17.2", "0.19.0", "1.0", "dev"):
        reason = hw._unguardable(version, worker_serve, TCPServer)
        assert reason is not None and f"hypercorn {version} is not a version" in reason

    async def other_worker() -> None:
        pass

    assert "no longer looks up TCPServer" in str(hw._unguardable("0.18.1", other_worker, TCPServer))

    class OtherServer:
        def __init__(self, app: Any, config: Any, stream: Any) -> None:
            pass

    assert "takes other arguments" in str(hw._unguardable("0.18.1", worker_serve, OtherServer))


async def test_an_unknown_hypercorn_is_served_unguarded_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from hcqa.serve import hypercorn_worker as hw

    monkeypatch.setattr(hw, "UNGUARDED", "hypercorn 9.9 is not a version hcqa's guard knows")
    monkeypatch.setattr(hw, "_worker", None)
    with caplog.at_level(logging.WARNING, "hcqa.serve.hypercorn_worker"):
        async with host("hypercorn") as port:
            await still_answers(port)
    assert "hypercorn 9.9 is not a version" in caplog.text
    assert "serving unguarded" in caplog.text


async def test_a_head_trickled_a_byte_at_a_time_is_served() -> None:
    async with host("hcqa") as port:
        head = b"GET /t HTTP/1.1\r\nHost: x\r\nX: " + b"v" * 6000 + b"\r\nConnection: close\r\n\r\n"
        statuses, closed = await exchange(port, head, pieces=1)
        assert statuses == [200] and closed


def _head(n: int) -> bytes:
    return b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"v" * n + b"\r\n\r\n"


def _feed_cpu(data: bytes, step: int) -> float:
    """The least CPU time of three parses of ``data`` fed ``step`` bytes at a time."""
    best = math.inf
    for _ in range(3):
        p = _Parser()
        t0 = time.process_time()
        for i in range(0, len(data), step):
            p.feed(data[i : i + step])
        best = min(best, time.process_time() - t0)
        assert [type(e) for e in p.events] == [_Request, type(END)]
    return best


def test_a_trickled_head_costs_cpu_linear_in_its_size() -> None:
    # a byte at a time: 10x the bytes must cost about 10x the CPU (quadratic: 100x)
    ratio = _feed_cpu(_head(60_000), 1) / _feed_cpu(_head(6_000), 1)
    assert ratio < 25, ratio


def test_100_continue_only_for_http_1_1_with_a_body() -> None:
    def parsed(data: bytes) -> _Request:
        p = _Parser()
        p.feed(data)
        req = p.events[0]
        assert isinstance(req, _Request), req
        return req

    expect = b"Expect: 100-continue\r\n"
    assert parsed(
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n" + expect + b"\r\n"
    ).continue_
    assert not parsed(b"POST / HTTP/1.0\r\nContent-Length: 4\r\n" + expect + b"\r\n").continue_
    assert not parsed(b"GET / HTTP/1.1\r\nHost: x\r\n" + expect + b"\r\n").continue_


def _events(p: _Parser) -> list[Any]:
    """The parser's events with each message's body joined (splits may cut it anywhere)."""
    out: list[Any] = []
    for e in p.events:
        if isinstance(e, bytes | bytearray) and out and isinstance(out[-1], bytes):
            out[-1] += e
        elif isinstance(e, bytearray):
            out.append(bytes(e))
        elif isinstance(e, _Request):
            out.append((e.method, e.target, e.version, e.headers, e.keep, e.chunked))
        elif isinstance(e, _BadRequest):
            out.append(e.status)  # which check saw it first may differ: llhttp's or hcqa's
        else:
            out.append(e)
    return out


STREAM = (
    b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
    + b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    + CHUNKED
    + b"3;e=1\r\nabc\r\n1\r\nd\r\n0\r\nT: v\r\n\r\n"
    + b"\r\nGET http://h/c HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=12), st.sampled_from([b"", b"GET /\n\n"]))
def test_any_split_parses_alike(cuts: list[int], tail: bytes) -> None:
    data = STREAM + tail
    whole = _Parser()
    whole.feed(data)
    split = _Parser()
    bounds = [0, *sorted(cuts), len(data)]
    for a, b in itertools.pairwise(bounds):
        split.feed(data[a:b])
    assert _events(split) == _events(whole)
    assert sum(isinstance(e, _Request) for e in whole.events) == 4


def _grammar(p: _Parser) -> list[Any]:
    """Check the events' order -- (head, body pieces, END)*, then maybe one unfinished
    message, then maybe one refusal last -- and return the heads and refusal statuses."""
    seen: list[Any] = []
    in_body = False
    for i, e in enumerate(p.events):
        if isinstance(e, _BadRequest):
            assert i == len(p.events) - 1, "events after a refusal"
            assert e.status in (400, 431, 505), e
            seen.append(e.status)
        elif isinstance(e, _Request):
            assert not in_body
            in_body = True
            seen.append((e.method, e.target, e.version, e.headers))
        else:
            assert in_body, "a body piece or END outside a message"
            in_body = e is not END
    return seen


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(STREAM) - 1), st.binary(max_size=3)), max_size=4),
    st.integers(1, 64),
)
def test_malformed_bytes_in_any_pieces_are_refused_never_raised(
    edits: list[tuple[int, bytes]], step: int
) -> None:
    data = bytearray(STREAM)
    for at, new in edits:  # overwrite, insert or delete a few bytes anywhere
        data[at : at + len(new) % 2 + 1] = new
    whole, split = _Parser(), _Parser()
    whole.feed(bytes(data))
    for i in range(0, len(data), step):
        split.feed(bytes(data[i : i + step]))
    a, b = _grammar(whole), _grammar(split)
    n = min(len(a), len(b))
    if n and (isinstance(a[n - 1], int) or isinstance(b[n - 1], int)):
        n -= 1  # which check refuses, and so the status, may differ at the refusal
    assert a[:n] == b[:n]
