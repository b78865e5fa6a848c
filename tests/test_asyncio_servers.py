"""The asyncio examples under real servers: FastAPI on uvicorn, and aiohttp, on loopback.

Bounded: a few dozen requests each, every await under a timeout.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import socket
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
                r = await client.get("/stats")
                assert r.json()["pipeline"]["completed"] == len(xs) + 1
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
