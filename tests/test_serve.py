"""The inference server (hcqa.serve): endpoints, errors, concurrency, /health under load."""

from __future__ import annotations

import gc
import importlib.util
import json
import re
import signal
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

import httpx
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
JSON = "application/json"


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
        # check=False: no dry run of a kernel that may wait on a test's gate
        pipe = hcqa.Pipeline(stages, in_shape=IN_SHAPE, depth=depth, check=False)
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
        assert stats["input"] == {"shape": [3], "dtype": "float32"}
        assert stats["batch_input"] == {"shape": [4, 3], "dtype": "float32"}
        assert stats["batcher"]["max_batch"] == 4
        assert stats["batcher"]["mean_batch"] is None  # no batch yet (NaN is not JSON)
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


NESTED = b"[" * 4000 + b"]" * 4000
WANT = "one sample float32[3] or a batch float32[n, 3]"


@pytest.mark.parametrize(
    ("body", "content_type", "status", "words"),
    [
        (b'{"inputs": [[1, 2], [4, 5]]}', JSON, 400, [WANT, "got shape [2, 2]"]),
        (b'{"inputs": [1, 2]}', JSON, 400, [WANT, "got shape [2]"]),
        (b'{"inputs": [[[1, 2, 3]]]}', JSON, 400, [WANT, "nested more than 2 deep"]),
        (b'{"inputs": [[1, 2, 3], [3]]}', JSON, 400, ["same length", "got 1 at inputs[1]"]),
        (b'{"inputs": [[1, 2, 3], 4]}', JSON, 400, [WANT, "got a number at inputs[1]"]),
        (b'{"inputs": ["a", "b", "c"]}', JSON, 400, ["numbers", "got a string at inputs[0]"]),
        (b'{"inputs": [1, true, 3]}', JSON, 400, ["numbers", "got a boolean at inputs[1]"]),
        (b'{"inputs": [[1, 2, 3], [1, 2, false]]}', JSON, 400, ["boolean at inputs[1][2]"]),
        (b'{"inputs": [1, {"a": 1}, 3]}', JSON, 400, ["got an object at inputs[1]"]),
        (b'{"inputs": [1, null, 3]}', JSON, 400, ["got null at inputs[1]"]),
        (b'{"inputs": true}', JSON, 400, [WANT, "got a boolean"]),
        (b'{"inputs": "1,2,3"}', JSON, 400, [WANT, "got a string"]),
        (b'{"inputs": {"x": [1, 2, 3]}}', JSON, 400, [WANT, "got an object"]),
        (b'{"inputs": []}', JSON, 400, [WANT, "got shape [0]"]),
        (b'{"inputs": [1, NaN, 3]}', JSON, 400, ["finite", "got NaN"]),
        (b'{"inputs": [1, 10' + b"0" * 400 + b", 3]}", JSON, 400, ["fit in float32"]),
        (b"[[1, 2, 3]]", JSON, 400, ['{"inputs": ...}', "got a list"]),
        (b'"inputs"', JSON, 400, ['{"inputs": ...}', "got a string"]),
        (b'{"x": 1}', JSON, 400, ['"inputs" key', "got 'x'"]),
        (b"not json", JSON, 400, ["not JSON"]),
        (b"\xff\xfe{}", JSON, 400, ["not JSON", "UTF-8"]),
        (b"", JSON, 400, ["not JSON"]),
        (NESTED, JSON, 400, ["nested too deeply"]),
        (b'{"inputs": ' + NESTED + b"}", JSON, 400, ["nested"]),
        (b"\0" * 10, RAW, 400, ["multiple of 12 bytes", WANT, "got 10 bytes"]),
        (b"", RAW, 400, ["multiple of 12 bytes", "got 0 bytes"]),
        (b"1,2,3", "text/csv", 415, ["application/octet-stream", "text/csv"]),
        (b"\0" * ((1 << 20) + 12), RAW, 413, ["larger than 1048576 bytes"]),
    ],
)
async def test_bad_input_is_a_one_line_error(
    body: bytes, content_type: str, status: int, words: list[str]
) -> None:
    async with server() as (port, pipe), await Client.connect("127.0.0.1", port) as c:
        r = await c.request("POST", "/infer", body, content_type)
        assert r.status == status, r.body
        assert r.body.count(b"\n") == 0
        if status != 200:
            message = r.json()["error"]
            for word in words:
                assert word in message, message
        before = pipe.statistics().completed
        # the server and the pipeline are unharmed
        assert (await c.request("POST", "/infer", sample(1).tobytes(), RAW)).status == 200
        assert pipe.statistics().completed == before + 1


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
    # The server, its clients and every earlier test's leftovers share this process: a full
    # collection of that heap stalled a probe 89 ms once (the CLI freezes its own heap once
    # its models are ready; serve() leaves a host's collector to the host, here the test).
    gc.collect()
    gc.freeze()
    try:
        async with server(slow_double) as (port, pipe):
            report = await loadtest.load_test(
                "127.0.0.1",
                port,
                clients=4,
                requests_per_client=3,
                payload=sample(2).tobytes(),
                idle_probes=20,
            )
    finally:
        gc.unfreeze()
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

    async with server(gated, depth=1, max_pending=2) as (port, _):
        answers: list[int] = []

        async def infer() -> None:
            async with await Client.connect("127.0.0.1", port) as c:
                answers.append((await c.request("POST", "/infer", sample(3).tobytes(), RAW)).status)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(infer)
            nursery.start_soon(infer)  # admitted, waits for the slot
            async with await Client.connect("127.0.0.1", port) as c:
                while (await c.request("GET", "/health")).json()["requests_pending"] < 2:
                    await trio.sleep(0.005)  # both requests admitted (one on the slot)
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
    with pytest.raises(hcqa.InvalidCommand, match=r"serve takes a models\.Model, a Pipeline"):
        make_app(object())
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
        with pytest.raises(ImportError, match=r"pip install -e '\.\[serve\]'"):
            await serve(pipe, port=0, http="hypercorn")


def test_cli_serve_reports_a_busy_port_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from hcqa.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        rc = main(["serve", "--port", port, "--width", "8", "--max-batch", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1
    assert "Address already in use" in err


def test_cli_serve_settles_the_garbage_collector_once_models_are_ready() -> None:
    """What ``hcqa serve`` built is frozen out of later collections (a full collection
    walked it all, stalling the loop 15-45 ms under load) and the youngest generation is
    collected every ``GC_GEN0`` allocations, not 700."""
    import gc

    from hcqa.cli.serve import GC_GEN0, _settle_gc

    before = gc.get_threshold()
    try:
        gc.unfreeze()
        kept = [[n] for n in range(100)]  # built before serving: lives as long as the server
        _settle_gc()
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold() == (GC_GEN0, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def slow_double_10ms(out: np.ndarray, x: np.ndarray) -> None:
    time.sleep(0.01)  # busy devices: single samples pile up behind a running batch
    np.multiply(x, 2, out=out)


async def test_64_concurrent_single_sample_clients_each_get_their_own_row() -> None:
    async with server(slow_double_10ms, max_wait=0.005) as (port, pipe):
        got: dict[int, Any] = {}
        failures: list[str] = []

        async def one_client(k: int) -> None:
            async with await Client.connect("127.0.0.1", port) as c:
                for i in range(2):
                    key = 100 * k + i
                    x = sample(key)[0]  # one sample: float32[3]
                    if (k + i) % 2:
                        r = await c.request("POST", "/infer", x.tobytes(), RAW)
                        y = np.frombuffer(r.body, "<f4") if r.status == 200 else None
                    else:
                        r = await c.request("POST", "/infer", json.dumps({"inputs": x.tolist()}))
                        y = np.float32(r.json()["outputs"]) if r.status == 200 else None
                    if y is None:
                        failures.append(f"{key}: {r.status} {r.body[:80]!r}")
                    got[key] = y

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for k in range(64):
                    nursery.start_soon(one_client, k)
        async with await Client.connect("127.0.0.1", port) as c:
            stats = (await c.request("GET", "/stats")).json()["batcher"]
    assert failures == []
    assert len(got) == 128
    for key, y in got.items():
        want = (sample(key)[0] * 2).sum(dtype=np.float32)
        assert y is not None and y.size == 1 and y.reshape(()) == want, (key, y, want)
    assert stats["samples"] == 128
    assert stats["mean_batch"] > 2  # batches really formed (max 4 rows)
    assert pipe.statistics().completed == stats["batches"]


async def test_without_a_batcher_single_samples_run_alone() -> None:
    async with server(max_batch=1) as (port, pipe), await Client.connect("127.0.0.1", port) as c:
        x = sample(7)
        for row in x:
            r = await c.request("POST", "/infer", json.dumps({"inputs": row.tolist()}).encode())
            assert r.status == 200
            assert r.json()["shape"] == []
            assert np.float32(r.json()["outputs"]) == (row * 2).sum(dtype=np.float32)
        assert (await c.request("GET", "/stats")).json()["batcher"] is None
        assert pipe.statistics().completed == 4
        # a batch of 6 rows runs as two pipeline batches, the last one padded
        six = np.concatenate([x, x[:2]])
        r = await c.request("POST", "/infer", six.tobytes(), RAW)
        assert r.headers["x-hcqa-shape"] == "6"
        np.testing.assert_array_equal(np.frombuffer(r.body, "<f4"), (six * 2).sum(axis=1))
        assert pipe.statistics().completed == 6


async def test_metrics_parse_as_prometheus_text() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async with server(slow_double_10ms) as (port, _), await Client.connect("127.0.0.1", port) as c:
        async with trio.open_nursery() as nursery:
            for k in range(6):
                nursery.start_soon(
                    partial(c.__class__.request, Client("127.0.0.1", port)),
                    "POST",
                    "/infer",
                    sample(k)[0].tobytes(),
                    RAW,
                )
        assert (await c.request("GET", "/nowhere")).status == 404
        stats = (await c.request("GET", "/stats")).json()["batcher"]
        r = await c.request("GET", "/metrics")
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert families["hcqa_requests"].type == "counter"
    infer_ok = (("endpoint", "/infer"), ("status", "200"))
    assert samples[("hcqa_requests_total", infer_ok)] == 6
    assert samples[("hcqa_requests_total", (("endpoint", "other"), ("status", "404")))] == 1
    assert families["hcqa_request_duration_seconds"].type == "histogram"
    assert samples[("hcqa_request_duration_seconds_count", (("endpoint", "/infer"),))] == 6
    sizes = families["hcqa_batch_size"]
    assert sizes.type == "histogram"
    model = ("model", "model")  # the model's own metrics carry its name
    assert samples[("hcqa_batch_size_count", (model,))] == stats["batches"]
    assert samples[("hcqa_batch_size_sum", (model,))] == 6
    assert samples[("hcqa_batch_size_bucket", (("le", "+Inf"), model))] == stats["batches"]
    assert samples[("hcqa_batch_size_bucket", (("le", "1"), model))] == stats["batch_sizes"][0]
    assert samples[("hcqa_batcher_queue_depth", (model,))] == 0
    assert samples[("hcqa_model_ready", (model,))] == 1
    assert samples[("hcqa_requests_pending", ())] == 0
    busy = {s.labels["device"]: s.value for s in families["hcqa_device_busy"].samples}
    assert busy == {"cpu:0": 0.0, "cpu:1": 0.0}
    assert {s.labels["device"] for s in families["hcqa_device_usable"].samples} == {
        "cpu:0",
        "cpu:1",
    }


async def test_each_app_has_its_own_metrics_registry() -> None:
    import httpx

    async with hcqa.open_device("cpu:0") as d:
        pipe = hcqa.Pipeline([(d, double)], in_shape=(2, 3))
        apps = [make_app(pipe), make_app(pipe)]
        transports = [httpx.ASGITransport(app=a) for a in apps]  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transports[0], base_url="http://a") as a:
            async with httpx.AsyncClient(transport=transports[1], base_url="http://b") as b:
                headers = {"content-type": RAW}
                for _ in range(3):
                    r = await a.post("/infer", content=sample(0)[:2].tobytes(), headers=headers)
                    assert r.status_code == 200
                text_a = (await a.get("/metrics")).text
                text_b = (await b.get("/metrics")).text
    line = 'hcqa_requests_total{endpoint="/infer",status="200"} 3.0'
    assert line in text_a
    assert "hcqa_requests_total{" not in text_b.replace('endpoint="/metrics"', "")


def test_cli_serve_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from hcqa.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for option, default in [
        ("--max-batch", "32"),
        ("--max-wait", "0.002"),
        ("--max-pending", "256"),
        ("--grace-period", "10.0"),
        ("--port", "8000"),
    ]:
        assert option in out
        assert f"(default: {default})" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--port", "99999"], "0..65535 (got 99999)"),
        (["--port", "-1"], ">= 0 (got -1)"),
        (["--max-batch", "0"], ">= 1 (got 0)"),
        (["--max-wait", "nan"], "finite number >= 0 (got nan)"),
        (["--max-wait", "-0.5"], "(got -0.5)"),
        (["--max-pending", "x"], "integer (got 'x')"),
        (["--grace-period", "inf"], "(got inf)"),
    ],
)
def test_cli_serve_checks_arguments_before_opening_devices(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hcqa.cli import main

    def no_devices(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("devices opened before the arguments were checked")

    monkeypatch.setattr(hcqa, "open_devices", no_devices)
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert words in err


def mlp_reference(x: np.ndarray, width: int) -> np.ndarray:
    """What ``hcqa serve``'s demo MLP (random weights from seed 0) computes."""
    rng = np.random.default_rng(0)
    scale = np.float32(1 / np.sqrt(width))
    w1, w2 = (rng.standard_normal((width, width), dtype=np.float32) * scale for _ in range(2))
    return np.maximum(x @ w1, 0) @ w2


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_cli_serve_drains_requests_in_flight_on_a_signal(signum: int) -> None:
    argv = [sys.executable, "-m", "hcqa.cli", "serve", "--port", "0", "--width", "8"]
    argv += ["--max-batch", "4", "--sleep-ms", "150", "--access-log", "-"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        with trio.fail_after(30):
            first = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
            match = re.search(r"http://127\.0\.0\.1:(\d+)", first)
            assert match, first
            port = int(match.group(1))
            rng = np.random.default_rng(5)
            inputs = [rng.standard_normal(8).astype(np.float32) for _ in range(5)]
            inputs.append(rng.standard_normal((3, 8)).astype(np.float32))  # one batch
            answers: dict[int, tuple[int, np.ndarray | None]] = {}

            async def infer(k: int) -> None:
                async with await Client.connect("127.0.0.1", port) as c:
                    r = await c.request("POST", "/infer", inputs[k].tobytes(), RAW)
                    y = np.frombuffer(r.body, "<f4") if r.status == 200 else None
                    answers[k] = (r.status, y)

            async with trio.open_nursery() as nursery:
                for k in range(len(inputs)):
                    nursery.start_soon(infer, k)
                async with await Client.connect("127.0.0.1", port) as c:
                    while (await c.request("GET", "/health")).json()["requests_pending"] < 6:
                        await trio.sleep(0.01)  # a real process: poll its state
                proc.send_signal(signum)  # all six in flight (kernels sleep 150 ms per stage)
                refused = False
                while len(answers) < 6 and not refused:
                    try:
                        async with await Client.connect("127.0.0.1", port) as c:
                            await c.request("GET", "/health")
                    except httpx.ConnectError:
                        refused = True  # no longer accepting
                    except httpx.TransportError:
                        pass  # accepted just before the listener closed, then closed unanswered
                    else:
                        await trio.sleep(0.01)
            rc = await trio.to_thread.run_sync(proc.wait)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, err = proc.communicate()
    assert rc == 0, err
    assert refused, err
    assert sorted(answers) == list(range(6))
    for k, (status, y) in answers.items():
        assert status == 200
        assert y is not None
        np.testing.assert_allclose(
            y.reshape(inputs[k].shape), mlp_reference(inputs[k], 8), rtol=1e-5, atol=1e-6
        )
    assert "draining" in err and "drained" in err
    assert out.count('"POST /infer 1.1" 200') == 6  # the access log


async def test_infer_reads_a_compressed_body() -> None:
    import gzip
    import zlib

    x = sample(3)
    raw = x.astype("<f4").tobytes()
    doc = json.dumps({"inputs": x.tolist()}).encode()
    async with (
        server() as (port, _),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30) as c,
    ):
        for ctype, encoded in [
            (RAW, gzip.compress(raw[:20]) + gzip.compress(raw[20:])),  # two members
            ("application/json", zlib.compress(doc)),
        ]:
            enc = "gzip" if encoded[:2] == b"\x1f\x8b" else "deflate"
            h = {"content-type": ctype, "content-encoding": enc}
            r = await c.post("/infer", content=encoded, headers=h)
            assert r.status_code == 200, r.content
            if ctype == RAW:
                np.testing.assert_array_equal(np.frombuffer(r.content, "<f4"), reference(x))
            else:
                np.testing.assert_array_equal(np.asarray(r.json()["outputs"], "f4"), reference(x))
        bad = [
            ("br", raw, 415, "gzip, deflate or identity"),
            ("gzip", gzip.compress(b"\0" * (2 << 20)), 413, "decompressed"),
            ("gzip", raw, 400, "not gzip data"),
        ]
        for enc, body, status, words in bad:
            h = {"content-type": RAW, "content-encoding": enc}
            r = await c.post("/infer", content=body, headers=h)
            assert r.status_code == status, r.content
            assert words in r.json()["error"]
