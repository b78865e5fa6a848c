"""hcqa's HTTP/1.1 server (hcqa.serve.http) at the byte level: framing, keep-alive,
pipelining, chunked bodies, refusals, disconnects and draining."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from hcqa.serve.http import BODY, serve_http


class EchoApp:
    """A bare ASGI app: ``/echo`` answers what it got; ``/stream`` answers in three pieces
    without a length; ``/boom`` raises; ``/wait`` waits for the client to leave."""

    def __init__(self) -> None:
        self.disconnected = trio.Event()
        self.waiting = trio.Event()
        self.release = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            msg = await receive()
            assert msg["type"] == "http.request", msg
            body += msg["body"]
            if not msg["more_body"]:
                break
        path = scope["path"]
        if path == "/boom":
            raise RuntimeError("boom")
        if path == "/wait":
            self.waiting.set()
            with trio.move_on_after(10):
                assert (await receive())["type"] == "http.disconnect"
                self.disconnected.set()
            return
        if path == "/slow":
            self.waiting.set()
            await self.release.wait()
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for piece in (b"one,", b"two,", b"three"):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        doc = {
            "method": scope["method"],
            "path": path,
            "query": scope["query_string"].decode(),
            "body": body.decode(),
            "version": scope["http_version"],
        }
        out = json.dumps(doc).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})


@asynccontextmanager
async def running(app: Any = None, **options: Any) -> AsyncIterator[tuple[int, Any, trio.Event]]:
    app = app or EchoApp()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(
                serve_http, app, host="127.0.0.1", port=0, shutdown_trigger=stop.wait, **options
            )
        )
        port = int(binds[0].rsplit(":", 1)[1])
        yield port, app, stop
        nursery.cancel_scope.cancel()


class Raw:
    """A byte-level client: send anything, read responses one by one."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    @classmethod
    async def connect(cls, port: int) -> Raw:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def more(self) -> bool:
        data = await self.stream.receive_some(65536)
        self.buf += data
        return bool(data)

    async def response(self, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        with trio.fail_after(10):
            while b"\r\n\r\n" not in self.buf:
                if not await self.more():
                    raise EOFError(self.buf)
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                assert k.lower() not in headers, f"{k} twice"
                headers[k.lower()] = v.strip()
            if head_only or status == 100:
                return status, headers, b""
            if headers.get("transfer-encoding") == "chunked":
                body = b""
                while True:
                    while b"\r\n" not in self.buf:
                        await self.more()
                    size_line, _, self.buf = self.buf.partition(b"\r\n")
                    size = int(size_line, 16)
                    while len(self.buf) < size + 2:
                        await self.more()
                    body, self.buf = body + self.buf[:size], self.buf[size + 2 :]
                    if size == 0:
                        return status, headers, body
            n = int(headers["content-length"])
            while len(self.buf) < n:
                if not await self.more():
                    raise EOFError(self.buf)
            body, self.buf = self.buf[:n], self.buf[n:]
            return status, headers, body

    async def closed(self) -> bool:
        """True once the server closed the connection (EOF) with nothing more sent."""
        with trio.fail_after(10):
            try:
                return not await self.more()
            except trio.BrokenResourceError:
                return True

    async def aclose(self) -> None:
        await self.stream.aclose()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


async def test_keep_alive_and_pipelined_requests_answer_in_order() -> None:
    async with running() as (port, _, _):
        c = await Raw.connect(port)
        await c.stream.send_all(post("/echo?a=1", b"first") + post("/echo%20x", b"second"))
        for want in (
            {"path": "/echo", "query": "a=1", "body": "first"},
            {"path": "/echo x", "query": "", "body": "second"},
        ):
            status, headers, body = await c.response()
            assert status == 200
            assert "connection" not in headers  # kept alive
            assert "date" in headers
            doc = json.loads(body)
            assert {k: doc[k] for k in want} == want
            assert (doc["method"], doc["version"]) == ("POST", "1.1")
        await c.stream.send_all(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await c.response()
        assert (status, json.loads(body)["body"]) == (200, "")
        await c.aclose()


async def test_chunked_request_bodies_and_streamed_responses() -> None:
    async with running() as (port, _, _):
        c = await Raw.connect(port)
        await c.stream.send_all(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nTrailer: t\r\n\r\n"
        )
        status, _, body = await c.response()
        assert (status, json.loads(body)["body"]) == (200, "hello, world")
        await c.stream.send_all(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await c.response()
        assert headers["transfer-encoding"] == "chunked"
        assert body == b"one,two,three"
        await c.aclose()


async def test_expect_100_continue_and_head() -> None:
    async with running() as (port, _, _):
        c = await Raw.connect(port)
        await c.stream.send_all(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        status, _, _ = await c.response()
        assert status == 100  # before the body is sent
        await c.stream.send_all(b"body")
        status, _, body = await c.response()
        assert (status, json.loads(body)["body"]) == (200, "body")
        await c.stream.send_all(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, _ = await c.response(head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        await c.stream.send_all(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")  # no HEAD body came
        status, _, body = await c.response()
        assert json.loads(body)["method"] == "GET"
        await c.aclose()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"get /echo HTTP/1.1\r\n\r\n", 400),
        (b"GET /echo HTTP/2.0\r\n\r\n", 505),
        (b"GET example.com HTTP/1.1\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nBad Name: 1\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
        (b"GET /echo HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        # refused as soon as seen, not after the head timeout: a bare LF (the head would
        # never end with CRLF CRLF), and HTTP/0.9 (a request line alone, no version)
        (b"GET /echo HTTP/1.1\n\n", 400),
        (b"GET /echo HTTP/1.1\r\nHost: x\n\n", 400),
        (b"GET /echo\r\n", 400),
    ],
)
async def test_malformed_requests_are_refused_and_the_connection_closes(
    request_bytes: bytes, status: int
) -> None:
    async with running() as (port, _, _):
        c = await Raw.connect(port)
        await c.stream.send_all(request_bytes)
        got, headers, _ = await c.response()
        assert got == status
        assert headers["connection"] == "close"
        assert await c.closed()
        c2 = await Raw.connect(port)  # the server is unharmed
        await c2.stream.send_all(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await c2.response())[0] == 200
        await c2.aclose()


async def test_http_1_0_closes_unless_asked_and_connection_close_is_honoured() -> None:
    async with running() as (port, _, _):
        c = await Raw.connect(port)
        await c.stream.send_all(b"GET /echo HTTP/1.0\r\n\r\n")
        status, headers, body = await c.response()
        assert (status, headers["connection"], json.loads(body)["version"]) == (200, "close", "1.0")
        assert await c.closed()
        c = await Raw.connect(port)
        await c.stream.send_all(b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" * 2)
        assert (await c.response())[0] == 200
        assert (await c.response())[0] == 200
        await c.aclose()
        c = await Raw.connect(port)
        await c.stream.send_all(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await c.response())[1]["connection"] == "close"
        assert await c.closed()


async def test_an_app_error_is_500_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async with running() as (port, _, _):
        c = await Raw.connect(port)
        with caplog.at_level(logging.ERROR, logger="hcqa.serve.http"):
            await c.stream.send_all(post("/boom", b""))
            status, headers, _ = await c.response()
        assert (status, headers["connection"]) == (500, "close")
        assert "RuntimeError: boom" in caplog.text
        assert await c.closed()


async def test_the_app_hears_a_client_leave() -> None:
    async with running() as (port, app, _):
        c = await Raw.connect(port)
        await c.stream.send_all(post("/wait", b"x"))
        with trio.fail_after(10):
            await app.waiting.wait()
        await c.aclose()
        with trio.fail_after(10):
            await app.disconnected.wait()


async def test_idle_and_slow_head_timeouts() -> None:
    async with running(keep_alive_timeout=0.2, head_timeout=0.2) as (port, _, _):
        c = await Raw.connect(port)
        await c.stream.send_all(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await c.response())[0] == 200
        assert await c.closed()  # idle past keep_alive_timeout
        c = await Raw.connect(port)
        await c.stream.send_all(b"GET /echo HTTP/1.1\r\nHost")  # and nothing more
        status, headers, _ = await c.response()
        assert (status, headers["connection"]) == (408, "close")


async def test_a_drain_finishes_requests_in_flight_and_answers_late_ones_503() -> None:
    async with running(grace_period=10, keep_alive_timeout=60) as (port, app, stop):
        idle, late = await Raw.connect(port), await Raw.connect(port)
        for c in (idle, late):
            await c.stream.send_all(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await c.response())[0] == 200
        busy = await Raw.connect(port)
        await busy.stream.send_all(post("/slow", b"x"))
        with trio.fail_after(10):
            await app.waiting.wait()
        stop.set()
        with pytest.raises(OSError):
            with trio.fail_after(10):
                await trio.open_tcp_stream("127.0.0.1", port)  # no longer accepting
        # a request sent on a keep-alive connection during the drain is answered, not run
        await late.stream.send_all(post("/echo", b"abc"))
        status, headers, body = await late.response()
        assert (status, headers["connection"]) == (503, "close")
        assert b"shutting down" in body
        assert await late.closed()
        app.release.set()
        status, headers, _ = await busy.response()
        assert (status, headers["connection"]) == (200, "close")
        assert await busy.closed()
        assert await idle.closed()  # once nothing is in flight, idle connections close


async def test_the_access_log_has_one_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.hcqa.access")
    async with running(access_log=log) as (port, _, _):
        c = await Raw.connect(port)
        with caplog.at_level(logging.INFO, logger="test.hcqa.access"):
            await c.stream.send_all(post("/echo?q=1", b"abc"))
            _, _, body = await c.response()
        await c.aclose()
    lines = [r.getMessage() for r in caplog.records if r.name == "test.hcqa.access"]
    assert len(lines) == 1
    assert lines[0].startswith(f'127.0.0.1 "POST /echo?q=1 1.1" 200 {len(body)} ')


class BodyApp:
    """Takes its body through the ``hcqa.body`` extension where it can, else ``receive``."""

    def __init__(self) -> None:
        self.taken: list[bytes | None] = []
        self.asked = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = scope["extensions"][BODY]()
        self.taken.append(body)
        self.asked.set()
        if body is None:
            body = b""
            while True:
                msg = await receive()
                body += msg["body"]
                if not msg["more_body"]:
                    break
        assert scope["extensions"][BODY]() is None  # read already: never twice
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def test_a_body_that_has_all_arrived_is_taken_at_once_by_the_body_extension() -> None:
    """``hcqa.body`` gives a body that is all queued (plain or chunked), leaving a pipelined
    request after it intact; a body still arriving is None, and ``receive`` reads it."""
    app = BodyApp()
    async with running(app) as (port, _, _):
        c = await Raw.connect(port)
        chunked = b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunked += b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        await c.stream.send_all(post("/a", b"hello") + chunked + post("/b", b""))
        for want in (b"hello", b"abcde", b""):
            assert (await c.response())[2] == want
        assert app.taken == [b"hello", b"abcde", b""]
        app.asked = trio.Event()
        await c.stream.send_all(post("/d", b"0123456789")[:-4])  # six bytes of ten
        await app.asked.wait()
        await c.stream.send_all(b"6789")
        assert (await c.response())[2] == b"0123456789"
        assert app.taken[3] is None
        await c.aclose()
