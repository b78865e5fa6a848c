"""The asyncio examples under real servers: FastAPI on uvicorn, and aiohttp, on loopback.

Bounded: a few dozen requests each, every await under a timeout.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from hcqa import aio

TIMEOUT = 30.0


def _example(name: str) -> Any:
    """Import ``examples/<name>.py`` (the examples are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"hcqa_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mlp_reference(x: np.ndarray, width: int) -> np.ndarray:
    """What ``hcqa.serve.mlp_pipeline(seed=0)`` computes, in plain numpy."""
    rng = np.random.default_rng(0)
    scale = np.float32(1 / math.sqrt(width))
    w1 = rng.standard_normal((width, width), dtype=np.float32) * scale
    w2 = rng.standard_normal((width, width), dtype=np.float32) * scale
    return np.maximum(x @ w1, 0) @ w2  # type: ignore[no-any-return]


def _loopback_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def test_fastapi_example_under_uvicorn() -> None:
    uvicorn = pytest.importorskip("uvicorn")
    example = _example("fastapi_app")
    batch, width = 4, 32
    app = example.create_app(batch=batch, width=width, depth=2)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((batch, width), dtype=np.float32) for _ in range(24)]

    async def main() -> None:
        sock = _loopback_socket()
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, lifespan="on", log_level="warning")
        server = uvicorn.Server(config)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        try:
            while not server.started:
                assert not serving.done(), "uvicorn did not start"
                await asyncio.sleep(0.01)
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as client:
                r = await client.get("/health")
                assert r.status_code == 200 and r.json()["status"] == "ok"

                async def raw(x: np.ndarray) -> np.ndarray:
                    r = await client.post(
                        "/infer",
                        content=x.astype("<f4").tobytes(),
                        headers={"content-type": "application/octet-stream"},
                    )
                    assert r.status_code == 200, r.text
                    assert r.headers["x-hcqa-shape"] == f"{batch},{width}"
                    return np.frombuffer(r.content, "<f4").reshape(batch, width)

                ys = await asyncio.gather(*(raw(x) for x in xs))  # concurrent clients
                for x, y in zip(xs, ys, strict=True):
                    np.testing.assert_allclose(y, _mlp_reference(x, width), rtol=1e-4, atol=1e-4)
                r = await client.post("/infer", json={"inputs": xs[0].tolist()})
                assert r.status_code == 200
                np.testing.assert_allclose(
                    np.asarray(r.json()["outputs"]),
                    _mlp_reference(xs[0], width),
                    rtol=1e-4,
                    atol=1e-4,
                )
                r = await client.post("/infer", json={"inputs": [[1.0, 2.0]]})
                assert r.status_code == 400 and r.json()["error"] == "InvalidCommand"
                r = await client.post(
                    "/infer", content=b"123", headers={"content-type": "application/octet-stream"}
                )
                assert r.status_code == 400 and "(got 3)" in r.json()["detail"]
                # any number of rows: one sample (JSON and raw), and 6 rows = 1 whole batch
                # of 4 straight to the pipeline + 2 rows through the batcher
                r = await client.post("/infer", json={"inputs": xs[1][0].tolist()})
                assert r.status_code == 200, r.text
                one = np.asarray(r.json()["outputs"])
                assert one.shape == (width,)
                want = _mlp_reference(xs[1], width)[0]
                np.testing.assert_allclose(one, want, rtol=1e-4, atol=1e-4)
                six = np.concatenate([xs[2], xs[3][:2]])
                for rows, shape in ((xs[4][:1], f"{width}"), (six, f"6,{width}")):
                    r = await client.post(
                        "/infer",
                        content=rows.astype("<f4").tobytes(),
                        headers={"content-type": "application/octet-stream"},
                    )
                    assert r.status_code == 200 and r.headers["x-hcqa-shape"] == shape, r.text
                    got = np.frombuffer(r.content, "<f4").reshape(len(rows), width)
                    want = _mlp_reference(rows, width)
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
                stats = (await client.get("/stats")).json()
                assert stats["batcher"]["samples"] == 4  # the lone rows, the 2 left over
                assert stats["pipeline"]["completed"] == len(xs) + 2 + stats["batcher"]["batches"]
            assert aio._hosts  # the lifespan holds the devices
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, TIMEOUT)
            sock.close()
        assert not aio._hosts  # shutdown closed the devices and ended the trio host

    asyncio.run(asyncio.wait_for(main(), TIMEOUT * 2))


def test_aiohttp_example() -> None:
    pytest.importorskip("aiohttp")
    from aiohttp import ClientSession, web

    example = _example("aiohttp_app")

    async def main() -> None:
        runner = web.AppRunner(example.make_app())
        await runner.setup()
        sock = _loopback_socket()
        try:
            site = web.SockSite(runner, sock)
            await site.start()
            port = sock.getsockname()[1]
            async with ClientSession(f"http://127.0.0.1:{port}") as session:

                async def one(k: int) -> None:
                    x = np.arange(8, dtype=np.float32).reshape(2, 4) + k
                    async with session.post("/infer", json={"inputs": x.tolist()}) as r:
                        assert r.status == 200
                        np.testing.assert_array_equal((await r.json())["outputs"], (x + 1) * 2)

                await asyncio.gather(*(one(k) for k in range(16)))
                # any number of rows: a lone sample and 3 rows (a whole batch of 2 + 1 row)
                # go through the batcher where they do not fill a batch
                for x in (np.arange(4, dtype=np.float32), np.arange(12, dtype=np.float32)):
                    x = x.reshape(-1, 4) if len(x) > 4 else x
                    async with session.post("/infer", json={"inputs": x.tolist()}) as r:
                        assert r.status == 200, await r.text()
                        np.testing.assert_array_equal((await r.json())["outputs"], (x + 1) * 2)
                async with session.post("/infer", json={"inputs": [1, 2]}) as r:
                    assert r.status == 400
        finally:
            await runner.cleanup()
            sock.close()
        assert not aio._hosts

    asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def test_hcqa_serve_app_under_uvicorn() -> None:
    """``hcqa.serve.make_app`` (Starlette) served by uvicorn on asyncio: /infer used to
    answer 500 there (issue 15); batched single samples and whole batches both work."""
    uvicorn = pytest.importorskip("uvicorn")
    import hcqa
    from hcqa.serve import make_app, mlp_pipeline

    batch, width = 4, 32

    async def main() -> None:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            pipe = await mlp_pipeline(d0, d1, batch=batch, width=width)
            async with hcqa.open_batcher(pipe, max_wait=0.002) as batcher:
                sock = _loopback_socket()
                port = sock.getsockname()[1]
                config = uvicorn.Config(make_app(pipe, batcher=batcher), log_level="warning")
                server = uvicorn.Server(config)
                serving = asyncio.ensure_future(server.serve(sockets=[sock]))
                try:
                    while not server.started:
                        assert not serving.done(), "uvicorn did not start"
                        await asyncio.sleep(0.01)
                    base = f"http://127.0.0.1:{port}"
                    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as client:
                        x = np.random.default_rng(2).standard_normal((batch, width))
                        x = x.astype(np.float32)
                        r = await client.post(
                            "/infer",
                            content=x.astype("<f4").tobytes(),
                            headers={"content-type": "application/octet-stream"},
                        )
                        assert r.status_code == 200, r.text
                        y = np.frombuffer(r.content, "<f4").reshape(batch, width)
                        np.testing.assert_allclose(
                            y, _mlp_reference(x, width), rtol=1e-4, atol=1e-4
                        )
                        rows = await asyncio.gather(
                            *(client.post("/infer", json={"inputs": row.tolist()}) for row in x)
                        )
                        for row, r in zip(x, rows, strict=True):
                            assert r.status_code == 200, r.text
                            np.testing.assert_allclose(
                                np.asarray(r.json()["outputs"]).reshape(width),
                                _mlp_reference(row[None, :], width)[0],
                                rtol=1e-4,
                                atol=1e-4,
                            )
                finally:
                    server.should_exit = True
                    await asyncio.wait_for(serving, TIMEOUT)
                    sock.close()
        assert not aio._hosts

    asyncio.run(asyncio.wait_for(main(), TIMEOUT * 2))


# -- a client that disconnects cancels its work -----------------------------------------------


class _Watched:
    """A pipeline that counts the calls that entered and left it (``pipe.in_shape`` etc. pass
    through), so a test can tell when the server's handlers are waiting on it."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.entered = 0
        self.left = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    async def __call__(self, x: Any) -> Any:
        self.entered += 1
        try:
            return await self.pipe(x)
        finally:
            self.left += 1


async def _until(what: str, ok: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll the server's state (a real server in this process) until ``ok()``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not ok():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.005)


async def _post_and_leave(port: int, body: bytes, content_type: str) -> asyncio.StreamWriter:
    """Send a whole POST /infer on a connection of its own; the caller closes it unanswered."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    return writer


def _gated_pipeline(device: Any, in_shape: tuple[int, ...]) -> tuple[Any, threading.Event]:
    """A depth-1 pipeline whose one stage (out = x) waits for the gate: its first call holds
    the only slot while others queue behind it."""
    import hcqa

    gate = threading.Event()

    def gated(out: np.ndarray, x: np.ndarray) -> None:
        gate.wait(TIMEOUT)
        np.copyto(out, x)

    return hcqa.Pipeline([(device, gated)], in_shape=in_shape, depth=1, check=False), gate


LEAVERS = 6


def test_fastapi_example_cancels_the_work_of_clients_that_disconnect() -> None:
    uvicorn = pytest.importorskip("uvicorn")
    example = _example("fastapi_app")
    batch, width = 2, 8
    app = example.create_app(batch=batch, width=width, depth=1)

    async def main() -> None:
        sock = _loopback_socket()
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        gate = threading.Event()
        try:
            await _until("uvicorn started", lambda: server.started or serving.done())
            pipe, gate = _gated_pipeline(app.state.devices[0], (batch, width))
            app.state.pipe = watched = _Watched(pipe)
            x = np.arange(batch * width, dtype=np.float32).reshape(batch, width)
            body = x.astype("<f4").tobytes()
            raw = {"content-type": "application/octet-stream"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                stays = asyncio.ensure_future(client.post("/infer", content=body, headers=raw))
                await _until("the first request holds the slot", lambda: watched.entered == 1)
                leavers = [
                    await _post_and_leave(port, body, raw["content-type"]) for _ in range(LEAVERS)
                ]
                await _until("all requests wait", lambda: watched.entered == 1 + LEAVERS)
                for writer in leavers:
                    writer.close()
                await _until(
                    "the disconnected clients' calls cancelled", lambda: watched.left == LEAVERS
                )
                gate.set()
                r = await asyncio.wait_for(stays, TIMEOUT)
                assert r.status_code == 200
                np.testing.assert_array_equal(np.frombuffer(r.content, "<f4").reshape(x.shape), x)
            stats = pipe.statistics()
            assert (stats.completed, stats.in_flight) == (1, 0)  # no work for the leavers
        finally:
            gate.set()
            server.should_exit = True
            await asyncio.wait_for(serving, TIMEOUT)
            sock.close()
        assert not aio._hosts

    asyncio.run(asyncio.wait_for(main(), TIMEOUT * 2))


def test_aiohttp_example_cancels_the_work_of_clients_that_disconnect() -> None:
    pytest.importorskip("aiohttp")
    from aiohttp import web

    import hcqa

    example = _example("aiohttp_app")
    app = example.make_app()
    gated: dict[str, Any] = {}

    async def swap(app: web.Application) -> Any:  # after the example's own cleanup context
        async with hcqa.open_devices("cpu:2") as (d,):
            gated["pipe"], gated["gate"] = _gated_pipeline(d, example.IN_SHAPE)
            app[example.PIPE] = gated["watched"] = _Watched(gated["pipe"])
            yield

    app.cleanup_ctx.append(swap)

    async def main() -> None:
        runner = web.AppRunner(app, **example.SERVER_OPTIONS)
        await runner.setup()
        sock = _loopback_socket()
        watched = gated["watched"]
        try:
            await web.SockSite(runner, sock).start()
            port = sock.getsockname()[1]
            x = np.arange(8, dtype=np.float32).reshape(example.IN_SHAPE)
            body = json.dumps({"inputs": x.tolist()}).encode()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                stays = asyncio.ensure_future(client.post("/infer", content=body))
                await _until("the first request holds the slot", lambda: watched.entered == 1)
                leavers = [
                    await _post_and_leave(port, body, "application/json") for _ in range(LEAVERS)
                ]
                await _until("all requests wait", lambda: watched.entered == 1 + LEAVERS)
                for writer in leavers:
                    writer.close()
                await _until(
                    "the disconnected clients' calls cancelled", lambda: watched.left == LEAVERS
                )
                gated["gate"].set()
                r = await asyncio.wait_for(stays, TIMEOUT)
                assert r.status_code == 200 and r.json()["outputs"] == x.tolist()
            stats = gated["pipe"].statistics()
            assert (stats.completed, stats.in_flight) == (1, 0)  # no work for the leavers
        finally:
            gated["gate"].set()
            await runner.cleanup()
            sock.close()
        assert not aio._hosts

    asyncio.run(asyncio.wait_for(main(), TIMEOUT * 2))
