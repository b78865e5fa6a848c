"""The inference server (hcqa.serve): endpoints, errors, concurrency, /health under load."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import hcqa

pytest.importorskip("hypercorn")

from hcqa.serve import make_app, serve


def _example(name: str) -> Any:
    """Import ``examples/<name>.py`` (the examples are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"hcqa_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


loadtest = _example("loadtest")
Client = loadtest.Client

IN_SHAPE = (4, 3)
RAW = "application/octet-stream"


def double(out: np.ndarray, x: np.ndarray) -> None:
    np.multiply(x, 2, out=out)


def row_sums(out: np.ndarray, x: np.ndarray) -> None:
    np.sum(x, axis=1, out=out)


def reference(x: np.ndarray) -> np.ndarray:
    return (x * 2).sum(axis=1)


@asynccontextmanager
async def server(
    first: Callable[..., None] = double, *, depth: int = 2, **options: Any
) -> AsyncIterator[tuple[int, hcqa.Pipeline]]:
    """A two-stage pipeline (cpu:0 -> cpu:1, float32[4, 3] -> float32[4]) served on a free port."""
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        stages = [
            hcqa.Stage(device=d0, program=first),
            hcqa.Stage(device=d1, program=row_sums, out_shape=(IN_SHAPE[0],)),
        ]
        pipe = hcqa.Pipeline(stages, in_shape=IN_SHAPE, depth=depth)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, pipe, port=0, **options))
            yield port, pipe
            nursery.cancel_scope.cancel()


def sample(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(IN_SHAPE).astype(np.float32)


async def test_health_and_stats() -> None:
    async with server() as (port, _), await Client.connect("127.0.0.1", port) as c:
        r = await c.request("GET", "/health")
        assert r.status == 200
        doc = r.json()
        assert doc["status"] == "ok"
        assert [d["name"] for d in doc["devices"]] == ["cpu:0", "cpu:1"]
        assert doc["pipeline"] == {"depth": 2, "in_flight": 0, "completed": 0}
        stats = (await c.request("GET", "/stats")).json()
        assert stats["input"] == {"shape": [4, 3], "dtype": "float32"}
        assert stats["output"] == {"shape": [4], "dtype": "float32"}
        assert len(stats["devices"]) == 2


async def test_infer_json_and_raw_round_trips() -> None:
    x = sample(0)
    async with server() as (port, _), await Client.connect("127.0.0.1", port) as c:
        r = await c.request("POST", "/infer", json.dumps({"inputs": x.tolist()}).encode())
        assert r.status == 200, r.body
        assert r.headers["content-type"] == "application/json"
        doc = r.json()
        assert (doc["shape"], doc["dtype"]) == ([4], "float32")
        np.testing.assert_array_equal(np.asarray(doc["outputs"], np.float32), reference(x))

        r = await c.request("POST", "/infer", x.astype("<f4").tobytes(), RAW)
        assert r.status == 200, r.body
        assert r.headers["content-type"] == RAW
        assert (r.headers["x-hcqa-shape"], r.headers["x-hcqa-dtype"]) == ("4", "float32")
        np.testing.assert_array_equal(np.frombuffer(r.body, "<f4"), reference(x))

        # a body over 64 KiB is decoded and encoded in a worker thread: same answer
        padded = json.dumps({"inputs": x.tolist()}).encode() + b" " * 70_000
        r = await c.request("POST", "/infer", padded)
        assert r.status == 200, r.body
        np.testing.assert_array_equal(np.asarray(r.json()["outputs"], np.float32), reference(x))

        # JSON ints are accepted for a float pipeline
        r = await c.request(
            "POST", "/infer", b'{"inputs": [[1, 2, 3], [0, 0, 0], [1, 1, 1], [2, 2, 2]]}'
        )
        assert r.status == 200
        assert r.json()["outputs"] == [12.0, 0.0, 6.0, 12.0]


@pytest.mark.parametrize(
    ("body", "content_type", "status", "words"),
    [
        (
            b'{"inputs": [[1, 2, 3], [4, 5, 6]]}',
            "application/json",
            400,
            ["float32[4, 3]", "[2, 3]"],
        ),
        (b'{"inputs": [[1, 2], [3]]}', "application/json", 400, ["float32[4, 3]", "ragged"]),
        (b'{"inputs": [["a", "b", "c"]]}', "application/json", 400, ["float32[4, 3]", "<U1"]),
        (b'{"x": 1}', "application/json", 400, ['"inputs"']),
        (b"not json", "application/json", 400, ["not JSON"]),
        (b"\0" * 10, RAW, 400, ["48 bytes", "float32[4, 3]", "got 10 bytes"]),
        (b"1,2,3", "text/csv", 415, ["application/octet-stream", "text/csv"]),
        (b"\0" * ((1 << 20) + 1), RAW, 413, ["larger than 1048576 bytes"]),
    ],
)
async def test_bad_input_is_a_one_line_error(
    body: bytes, content_type: str, status: int, words: list[str]
) -> None:
    async with server() as (port, pipe), await Client.connect("127.0.0.1", port) as c:
        r = await c.request("POST", "/infer", body, content_type)
        assert r.status == status
        assert r.body.count(b"\n") == 0
        message = r.json()["error"]
        for word in words:
            assert word in message
        # the server and the pipeline are unharmed
        assert (await c.request("POST", "/infer", sample(1).tobytes(), RAW)).status == 200
        assert pipe.statistics().completed == 1


async def test_client_reconnects_when_the_server_closes_a_connection() -> None:
    options = {"keep_alive_max_requests": 3}
    async with server(hypercorn_options=options) as (port, _):
        async with await Client.connect("127.0.0.1", port) as c:
            for _ in range(10):
                assert (await c.request("GET", "/health")).status == 200


async def test_routes_and_methods() -> None:
    async with server() as (port, _), await Client.connect("127.0.0.1", port) as c:
        assert (await c.request("GET", "/infer")).status == 405
        assert (await c.request("POST", "/health", b"{}")).status == 405
        r = await c.request("GET", "/nowhere")
        assert r.status == 404
        assert "/infer" in r.json()["error"]


async def test_concurrent_clients_all_correct() -> None:
    async with server() as (port, pipe):
        failures: list[str] = []

        async def one_client(k: int) -> None:
            async with await Client.connect("127.0.0.1", port) as c:
                for i in range(5):
                    x = sample(100 * k + i)
                    r = await c.request("POST", "/infer", x.tobytes(), RAW)
                    if r.status != 200 or not np.array_equal(
                        np.frombuffer(r.body, "<f4"), reference(x)
                    ):
                        failures.append(f"client {k} request {i}: {r.status} {r.body[:80]!r}")

        async with trio.open_nursery() as nursery:
            for k in range(8):
                nursery.start_soon(one_client, k)
        assert failures == []
        assert pipe.statistics().completed == 40


def slow_double(out: np.ndarray, x: np.ndarray) -> None:
    time.sleep(0.1)  # a kernel that keeps its device busy for 100 ms (GIL released, as BLAS does)
    np.multiply(x, 2, out=out)


async def test_health_answers_in_milliseconds_while_kernels_run() -> None:
    async with server(slow_double) as (port, pipe):
        report = await loadtest.load_test(
            "127.0.0.1",
            port,
            clients=4,
            requests_per_client=3,
            payload=sample(2).tobytes(),
            idle_probes=20,
        )
    assert (report.requests, report.errors) == (12, 0)
    assert report.seconds > 1.0  # 12 microbatches of 100 ms through one slow stage
    assert report.health_probes >= 20
    assert report.health_max_ms < 50, str(report)  # kernels take 100 ms each
    assert pipe.statistics().completed == 12


async def test_health_while_every_slot_is_blocked_and_max_pending() -> None:
    gate = threading.Event()

    def gated(out: np.ndarray, x: np.ndarray) -> None:
        gate.wait(10)
        np.multiply(x, 2, out=out)

    async with server(gated, depth=1, max_pending=2) as (port, pipe):
        answers: list[int] = []

        async def infer() -> None:
            async with await Client.connect("127.0.0.1", port) as c:
                answers.append((await c.request("POST", "/infer", sample(3).tobytes(), RAW)).status)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(infer)
            nursery.start_soon(infer)  # admitted, waits for the slot
            async with await Client.connect("127.0.0.1", port) as c:
                while pipe.statistics().in_flight < 1:
                    await trio.sleep(0.005)
                await trio.sleep(0.02)
                worst = 0.0
                for _ in range(10):  # the kernel is blocked: probe meanwhile
                    t0 = time.perf_counter()
                    r = await c.request("GET", "/health")
                    worst = max(worst, time.perf_counter() - t0)
                    assert r.json()["requests_pending"] == 2
                    assert r.json()["pipeline"]["in_flight"] == 1
                assert worst < 0.05
                r = await c.request("POST", "/infer", sample(4).tobytes(), RAW)
                assert r.status == 503  # a third request is turned away, not queued
                assert "limit 2" in r.json()["error"]
                gate.set()
        assert answers == [200, 200]


async def test_a_client_that_disconnects_leaves_the_queue() -> None:
    gate = threading.Event()

    def gated(out: np.ndarray, x: np.ndarray) -> None:
        gate.wait(10)
        np.multiply(x, 2, out=out)

    async def pending(c: Any) -> int:
        return int((await c.request("GET", "/health")).json()["requests_pending"])

    async with server(gated, depth=1) as (port, pipe), await Client.connect("127.0.0.1", port) as c:
        statuses: list[int] = []

        async def infer(client: Any) -> None:
            r = await client.request("POST", "/infer", sample(6).tobytes(), RAW)
            statuses.append(r.status)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(infer, await Client.connect("127.0.0.1", port))  # takes the slot
            leaving = await Client.connect("127.0.0.1", port)
            with trio.fail_after(5):
                async with trio.open_nursery() as waiting:
                    waiting.start_soon(infer, leaving)  # waits for the slot
                    while await pending(c) < 2:
                        await trio.sleep(0.005)
                    waiting.cancel_scope.cancel()
            with trio.fail_after(5):
                await leaving.aclose()  # the client goes away while its request waits
                while await pending(c) != 1:
                    await trio.sleep(0.005)
            gate.set()
    assert statuses == [200]
    assert pipe.statistics().completed == 1


async def test_device_fault_is_500_and_health_503() -> None:
    def broken(out: np.ndarray, x: np.ndarray) -> None:
        raise ValueError("kernel exploded")

    async with server(broken) as (port, _), await Client.connect("127.0.0.1", port) as c:
        r = await c.request("POST", "/infer", sample(5).tobytes(), RAW)
        assert r.status == 500
        assert r.json()["error"].startswith("DeviceFault:")
        r = await c.request("GET", "/health")
        assert r.status == 503
        doc = r.json()
        assert doc["status"] == "unavailable"
        assert "cpu:0" in doc["unavailable"]  # (cpu:1, waiting on cpu:0, shares its fault)
        assert doc["devices"][0]["faulted"] is True


async def test_the_inference_server_example() -> None:
    example = _example("inference_server")
    x = np.arange(example.BATCH * example.FEATURES, dtype=np.float32).reshape(example.BATCH, -1)
    x = (x * x) % 11
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        pipe = await example.build_pipeline(d0, d1)
        want = await pipe(x)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, pipe, port=0))
            async with await Client.connect("127.0.0.1", port) as c:
                r = await c.request("POST", "/infer", json.dumps({"inputs": x.tolist()}).encode())
            nursery.cancel_scope.cancel()
    assert r.status == 200
    got = np.asarray(r.json()["outputs"], np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got.sum(axis=1), 1, rtol=1e-5)


async def test_make_app_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match=r"hcqa\.Pipeline"):
        make_app(object())  # type: ignore[arg-type]
    async with hcqa.open_device("cpu:0") as d:
        pipe = hcqa.Pipeline([(d, double)], in_shape=(2,))
        with pytest.raises(ValueError, match="max_pending"):
            make_app(pipe, max_pending=0)


def test_hypercorn_is_imported_lazily() -> None:
    code = (
        "import sys, hcqa, hcqa.serve; "
        "assert 'hypercorn' not in sys.modules and 'h11' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_missing_hypercorn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "hypercorn" or m.startswith("hypercorn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hypercorn", None)
    async with hcqa.open_device("cpu:0") as d:
        pipe = hcqa.Pipeline([(d, double)], in_shape=(2,))
        with pytest.raises(ImportError, match=r"pip install 'hcqa\[serve\]'"):
            await serve(pipe, port=0)


def test_cli_serve_reports_a_busy_port_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from hcqa.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc = main(["serve", "--port", str(busy.getsockname()[1]), "--width", "8", "--batch", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1
    assert "Address already in use" in err
