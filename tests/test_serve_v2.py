"""The Open Inference Protocol (KServe v2) in hcqa.serve, driven by the real tritonclient.http.

tritonclient.http is blocking (geventhttpclient): each test runs it in a worker thread
(``trio.to_thread.run_sync``) against a server on 127.0.0.1 in the test's own trio run.
"""

from __future__ import annotations

import gzip
import json
import re
import signal
import subprocess
import sys
import threading
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import numpy as np
import pytest
import trio

import hcqa

pytest.importorskip("hypercorn")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from hcqa.serve import Model, serve  # noqa: E402

SUMS_IN = (4, 3)  # model "sums": float32[n, 3] -> float32[n]: (2 x).sum(axis=1)
AFFINE_IN = (8, 5)  # model "affine": float32[n, 5] -> float32[n, 5]: 3 x + 1


def double(out: np.ndarray, x: np.ndarray) -> None:
    np.multiply(x, 2, out=out)


def row_sums(out: np.ndarray, x: np.ndarray) -> None:
    np.sum(x, axis=1, out=out)


def affine(out: np.ndarray, x: np.ndarray) -> None:
    np.multiply(x, 3, out=out)
    np.add(out, 1, out=out)


def sums_ref(x: np.ndarray) -> np.ndarray:
    return np.asarray([row_sums_one(r) for r in x], np.float32)


def row_sums_one(r: np.ndarray) -> np.float32:
    out = np.empty((1,), np.float32)
    row_sums(out, (r * 2)[None])
    return out[0]


def affine_ref(x: np.ndarray) -> np.ndarray:
    y = np.empty_like(x)
    affine(y, x)
    return y


@asynccontextmanager
async def server(
    first: Callable[..., None] = double, *, depth: int = 2, **options: Any
) -> AsyncIterator[tuple[int, hcqa.Pipeline]]:
    """Two models on cpu:0 -> cpu:1 served on a free port; yields (port, the sums pipeline)."""
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        sums = hcqa.Pipeline(
            [
                hcqa.Stage(device=d0, program=first),
                hcqa.Stage(device=d1, program=row_sums, out_shape=(SUMS_IN[0],)),
            ],
            in_shape=SUMS_IN,
            depth=depth,
            check=False,  # no dry run of a kernel that may wait on a test's gate
        )
        aff = hcqa.Pipeline([hcqa.Stage(device=d1, program=affine)], in_shape=AFFINE_IN)
        models = [Model(name="sums", pipeline=sums), Model(name="affine", pipeline=aff)]
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve, models, port=0, **options))
            yield port, sums
            nursery.cancel_scope.cancel()


def http(port: int) -> httpx.AsyncClient:
    """A plain HTTP client for what tritonclient can't send (malformed bodies)."""
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30)


async def triton(port: int, fn: Callable[[Any], Any]) -> Any:
    """``fn(client)`` with a tritonclient.http client, in a worker thread."""

    def run() -> Any:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=30)
        try:
            return fn(client)
        finally:
            client.close()

    return await trio.to_thread.run_sync(run)


def data(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


async def test_metadata_readiness_and_the_repository_index() -> None:
    def check(c: Any) -> None:
        assert c.is_server_live()
        assert c.is_server_ready()
        meta = c.get_server_metadata()
        assert meta["name"] == "hcqa"
        assert meta["version"] == hcqa.__version__
        assert "binary_tensor_data" in meta["extensions"]
        assert c.get_model_metadata("sums") == {
            "name": "sums",
            "versions": ["1"],
            "platform": "hcqa",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1]}],
        }
        aff = c.get_model_metadata("affine", model_version="1")
        assert aff["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 5]}]
        assert aff["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 5]}]
        assert c.is_model_ready("sums") and c.is_model_ready("affine", "1")
        assert not c.is_model_ready("nope")
        assert not c.is_model_ready("sums", "7")
        index = c.get_model_repository_index()
        assert [(m["name"], m["version"], m["state"]) for m in index] == [
            ("sums", "1", "READY"),
            ("affine", "1", "READY"),
        ]
        with pytest.raises(InferenceServerException) as info:
            c.get_model_metadata("nope")
        assert info.value.status() == "404"
        assert "unknown model 'nope'" in info.value.message()
        assert "sums, affine" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            c.get_model_metadata("sums", model_version="2")
        assert info.value.status() == "404"
        assert "no version '2'" in info.value.message()

    async with server() as (port, _):
        await triton(port, check)


@pytest.mark.parametrize("binary_in", [False, True])
@pytest.mark.parametrize("binary_out", [False, True])
async def test_infer_every_output_matches_numpy(binary_in: bool, binary_out: bool) -> None:
    """Batches of 1 (through the batcher), fewer rows than the pipeline's batch (padded) and
    more (in chunks), JSON or binary each way; results equal numpy's exactly (same kernels,
    float32 end to end: JSON numbers are the float32 values written as float64)."""

    def infer(c: Any, model: str, x: np.ndarray) -> tuple[np.ndarray, Any]:
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary_in)
        out = httpclient.InferRequestedOutput("output", binary_data=binary_out)
        r = c.infer(model, [inp], outputs=[out], request_id=f"{model}-{len(x)}")
        return r.as_numpy("output"), r.get_response()

    def check(c: Any) -> None:
        for n in (1, 3, 4, 9):
            x = data((n, 3), n)
            y, doc = infer(c, "sums", x)
            assert y.dtype == np.float32 and y.shape == (n,)
            np.testing.assert_array_equal(y, sums_ref(x))
            assert doc["model_name"] == "sums" and doc["model_version"] == "1"
            assert doc["id"] == f"sums-{n}"
            assert doc["outputs"][0]["datatype"] == "FP32"
            assert ("parameters" in doc["outputs"][0]) is binary_out
            x = data((n, 5), 100 + n)
            y, _ = infer(c, "affine", x)
            assert y.shape == (n, 5)
            np.testing.assert_array_equal(y, affine_ref(x))
        # no outputs named: tritonclient asks for every output in binary
        x = data((2, 5), 7)
        inp = httpclient.InferInput("input", [2, 5], "FP32")
        inp.set_data_from_numpy(x, binary_data=binary_in)
        np.testing.assert_array_equal(c.infer("affine", [inp]).as_numpy("output"), affine_ref(x))

    async with server() as (port, _):
        await triton(port, check)


async def test_many_clients_at_once_each_get_their_own_rows() -> None:
    results: dict[int, np.ndarray] = {}

    async def one(port: int, k: int) -> None:
        def run(c: Any) -> np.ndarray:
            inp = httpclient.InferInput("input", [1, 3], "FP32")
            inp.set_data_from_numpy(data((1, 3), 1000 + k))
            return np.asarray(c.infer("sums", [inp]).as_numpy("output"))

        results[k] = await triton(port, run)

    async with server() as (port, pipe):
        async with trio.open_nursery() as nursery:
            for k in range(12):
                nursery.start_soon(one, port, k)
        batches = pipe.statistics().completed
    for k in range(12):
        np.testing.assert_array_equal(results[k], sums_ref(data((1, 3), 1000 + k)))
    assert batches < 12  # single samples shared batches


@pytest.mark.parametrize(
    ("model", "shape", "datatype", "status", "words"),
    [
        ("sums", [2, 4], "FP32", "400", ["input 'input'", "expected shape [-1, 3]", "[2, 4]"]),
        ("sums", [3], "FP32", "400", ["expected shape [-1, 3]", "got [3]"]),
        ("sums", [2, 3], "INT32", "400", ["expected datatype FP32", '"INT32"']),
        ("sums", [2, 3], "FP64", "400", ["expected datatype FP32", '"FP64"']),
        ("nope", [2, 3], "FP32", "404", ["unknown model 'nope'", "sums, affine"]),
    ],
)
async def test_bad_requests_surface_in_the_client_with_the_servers_message(
    model: str, shape: list[int], datatype: str, status: str, words: list[str]
) -> None:
    dtypes = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32}

    def check(c: Any) -> None:
        inp = httpclient.InferInput("input", shape, datatype)
        inp.set_data_from_numpy(np.ones(shape, dtypes[datatype]))
        with pytest.raises(InferenceServerException) as info:
            c.infer(model, [inp])
        assert info.value.status() == status
        for word in words:
            assert word in info.value.message(), info.value.message()
        # the server is unharmed
        ok = httpclient.InferInput("input", [1, 3], "FP32")
        ok.set_data_from_numpy(np.ones((1, 3), np.float32))
        assert c.infer("sums", [ok]).as_numpy("output").tolist() == [6.0]

    async with server() as (port, _):
        await triton(port, check)


async def test_unknown_input_and_output_names() -> None:
    def check(c: Any) -> None:
        inp = httpclient.InferInput("x", [1, 3], "FP32")
        inp.set_data_from_numpy(np.ones((1, 3), np.float32))
        with pytest.raises(InferenceServerException, match='unknown input "x"'):
            c.infer("sums", [inp])
        inp = httpclient.InferInput("input", [1, 3], "FP32")
        inp.set_data_from_numpy(np.ones((1, 3), np.float32))
        with pytest.raises(InferenceServerException, match="unknown output 'y'"):
            c.infer("sums", [inp], outputs=[httpclient.InferRequestedOutput("y")])

    async with server() as (port, _):
        await triton(port, check)


def _body(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def _inp(data: Any, shape: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": shape, "data": data}],
        **extra,
    }


NESTED_OK = _body(_inp([[1, 2, 3], [4, 5, 6]], [2, 3]))


@pytest.mark.parametrize(
    ("body", "headers", "words"),
    [
        (b"not json", {}, ["not JSON"]),
        (b"[1]", {}, ["JSON object"]),
        (_body({"inputs": []}), {}, ["'inputs'", "the tensor 'input'"]),
        (_body({"inputs": 3}), {}, ["'inputs' must be a list"]),
        (_body(_inp([1, 2, 3, 4], [1, 3])), {}, ["holds 3 elements", "got 4"]),
        (_body(_inp([[1, 2], [3, 4]], [2, 3])), {}, ["nested 'data' must have shape [2, 3]"]),
        (_body(_inp([1, True, 3], [1, 3])), {}, ["numbers", "a boolean at element 1"]),
        (_body(_inp([1, "2", 3], [1, 3])), {}, ["a string at element 1"]),
        (_body(_inp([1, None, 3], [1, 3])), {}, ["null at element 1"]),
        (_body(_inp("1 2 3", [1, 3])), {}, ["'data' must be a list", "a string"]),
        (
            b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3], '
            b'"data": [1, NaN, 3]}]}',
            {},
            ["finite", "NaN"],
        ),
        (_body(_inp([1, 1e39, 3], [1, 3])), {}, ["fit in FP32", "1e+39 at element 1"]),
        (
            b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3], '
            b'"data": [1, 2, -1e400]}]}',
            {},
            ["fit in a 64-bit float", "got -1e400"],
        ),
        (_body(_inp([1, 2, 3], [0, 3])), {}, ["batch size >= 1"]),
        (_body(_inp([1, 2, 3], [1, 3], parameters={"timeout": -1})), {}, ["'timeout'", ">= 0"]),
        (_body(_inp([1, 2, 3], [1, 3], parameters={"timeout": 0.5})), {}, ["microseconds"]),
        (
            _body(_inp([1, 2, 3], [1, 3], parameters={"binary_data_output": "yes"})),
            {},
            ["'binary_data_output' must be true or false"],
        ),
        (_body(_inp([1, 2, 3], [1, 3], id=5)), {}, ["'id' must be a string"]),
        (NESTED_OK + b"xx", {"Inference-Header-Content-Length": "abc"}, ["byte count"]),
        (NESTED_OK, {"Inference-Header-Content-Length": "99999"}, ["byte count"]),
        (
            NESTED_OK + b"extra",
            {"Inference-Header-Content-Length": str(len(NESTED_OK))},
            ["5 bytes", "add up to 0"],
        ),
    ],
)
async def test_bad_bodies_are_400_with_what_was_expected(
    body: bytes, headers: dict[str, str], words: list[str]
) -> None:
    async with server() as (port, _), http(port) as c:
        r = await c.post("/v2/models/sums/infer", content=body, headers=headers)
        assert r.status_code == 400, r.content
        message = r.json()["error"]
        for word in words:
            assert word in message, message
        r = await c.post("/v2/models/sums/infer", content=NESTED_OK)
        assert r.status_code == 200, r.content
        doc = r.json()
        assert doc["outputs"] == [
            {"name": "output", "datatype": "FP32", "shape": [2], "data": [12.0, 30.0]}
        ]


def _binary_request(x: np.ndarray, declared: int) -> tuple[bytes, dict[str, str]]:
    head = _body(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "parameters": {"binary_data_size": declared},
                }
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    )
    return head + x.astype("<f4").tobytes(), {"Inference-Header-Content-Length": str(len(head))}


async def test_binary_data_sizes_are_checked_and_binary_answers_are_framed() -> None:
    x = data((2, 3), 3)
    url = "/v2/models/sums/infer"
    async with server() as (port, _), http(port) as c:
        body, headers = _binary_request(x, 24)
        r = await c.post(url, content=body, headers=headers)
        assert r.status_code == 200, r.content
        assert r.headers["content-type"] == "application/octet-stream"
        n = int(r.headers["inference-header-content-length"])
        doc = json.loads(r.content[:n])
        assert doc["outputs"][0]["parameters"] == {"binary_data_size": 8}
        np.testing.assert_array_equal(np.frombuffer(r.content[n:], "<f4"), sums_ref(x))
        for declared in (20, True, "24"):
            body, headers = _binary_request(x, declared)  # type: ignore[arg-type]
            r = await c.post(url, content=body, headers=headers)
            assert r.status_code == 400
            assert "binary_data_size must be 24 bytes" in r.json()["error"]
        body, headers = _binary_request(x, 24)
        r = await c.post(url, content=body[:-4], headers=headers)
        assert r.status_code == 400
        assert "only 20 bytes follow" in r.json()["error"]


async def test_a_timed_out_request_is_cancelled_before_its_work_runs() -> None:
    """Request A holds the only pipeline slot (its kernel waits on a gate); request B, with
    parameters.timeout = 200 ms, waits in the batcher. B times out: 504 with the protocol's
    error, and its row never runs: once A finishes, one sample ran in one batch."""
    gate = threading.Event()
    started = threading.Event()

    def gated(out: np.ndarray, x: np.ndarray) -> None:
        started.set()
        gate.wait(10)
        np.multiply(x, 2, out=out)

    answers: dict[str, Any] = {}

    def request_a(c: Any) -> None:
        inp = httpclient.InferInput("input", [1, 3], "FP32")
        inp.set_data_from_numpy(np.ones((1, 3), np.float32))
        answers["a"] = c.infer("sums", [inp]).as_numpy("output")

    def request_b(c: Any) -> None:
        inp = httpclient.InferInput("input", [1, 3], "FP32")
        inp.set_data_from_numpy(np.full((1, 3), 2, np.float32))
        with pytest.raises(InferenceServerException) as info:
            c.infer("sums", [inp], timeout=200_000)
        answers["b"] = info.value

    async def stats(c: httpx.AsyncClient) -> dict[str, Any]:
        return dict((await c.get("/stats")).json())

    async with server(gated, depth=1) as (port, pipe), http(port) as c:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(triton, port, request_a)
            with trio.fail_after(10):
                await trio.to_thread.run_sync(started.wait)  # A's kernel runs: the slot is taken
            with trio.fail_after(10):
                await triton(port, request_b)
            s = await stats(c)
            assert s["batcher"]["cancelled"] == 1
            assert s["batcher"]["pending"] == 0  # B left the queue
            gate.set()
        s = await stats(c)
    assert answers["b"].status() == "504"
    assert "timed out" in answers["b"].message()
    assert "200000 us" in answers["b"].message()
    assert answers["a"].tolist() == [6.0]
    assert (s["batcher"]["batches"], s["batcher"]["samples"]) == (1, 1)
    assert pipe.statistics().completed == 1


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/v2", "/v2"),
        ("/v2/health/ready", "/v2/health/ready"),
        ("/v2/repository/index", "/v2/repository/index"),
        ("/v2/models/sums", "/v2/models/{model}"),
        ("/v2/models/anything/infer", "/v2/models/{model}/infer"),
        ("/v2/models/sums/versions/1/infer", "/v2/models/{model}/infer"),
        ("/v2/models/sums/versions/1/ready", "/v2/models/{model}/ready"),
        ("/v2/models/sums/versions/infer", "/v2/models/{model}"),
        ("/v2/nowhere", "other"),
        ("/infer/", "/infer"),
    ],
)
def test_metrics_label_a_route_never_a_model_name(path: str, label: str) -> None:
    from hcqa.serve.metrics import endpoint_of

    assert endpoint_of(path) == label


async def test_v2_requests_are_counted_by_route() -> None:
    async with server() as (port, _), http(port) as c:
        for model in ("sums", "nope", "affine"):
            await c.post(f"/v2/models/{model}/infer", content=NESTED_OK)
        text = (await c.get("/metrics")).text
    route = 'endpoint="/v2/models/{model}/infer"'
    assert f'hcqa_requests_total{{{route},status="200"}} 1.0' in text
    assert f'hcqa_requests_total{{{route},status="400"}} 1.0' in text  # affine: 5 columns
    assert f'hcqa_requests_total{{{route},status="404"}} 1.0' in text


def mlp_reference(x: np.ndarray, width: int) -> np.ndarray:
    """What ``hcqa serve``'s demo MLP (random weights from seed 0) computes."""
    rng = np.random.default_rng(0)
    scale = np.float32(1 / np.sqrt(width))
    w1, w2 = (rng.standard_normal((width, width), dtype=np.float32) * scale for _ in range(2))
    return np.asarray(np.maximum(x @ w1, 0) @ w2)


async def test_cli_serves_several_models_each_with_its_batcher() -> None:
    argv = [sys.executable, "-m", "hcqa.cli", "serve", "--port", "0", "--access-log", "none"]
    argv += ["--model", "small:8", "--model", "wide:24", "--max-batch", "4"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with trio.fail_after(60):
            banner = [
                await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
                for _ in range(4)
            ]
            match = re.search(r"http://127\.0\.0\.1:(\d+)", banner[0])
            assert match, banner

            def check(c: Any) -> None:
                index = c.get_model_repository_index()
                assert [(m["name"], m["state"]) for m in index] == [
                    ("small", "READY"),
                    ("wide", "READY"),
                ]
                for name, width in (("small", 8), ("wide", 24)):
                    meta = c.get_model_metadata(name)
                    assert meta["inputs"][0]["shape"] == [-1, width]
                    for n in (1, 3, 6):
                        x = data((n, width), n)
                        inp = httpclient.InferInput("input", [n, width], "FP32")
                        inp.set_data_from_numpy(x)
                        y = c.infer(name, [inp]).as_numpy("output")
                        # float32 matmuls whose BLAS path depends on the batch size
                        np.testing.assert_allclose(y, mlp_reference(x, width), rtol=1e-5, atol=1e-6)

            await triton(int(match.group(1)), check)
            proc.send_signal(signal.SIGTERM)
            rc = await trio.to_thread.run_sync(proc.wait)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _, err = proc.communicate()
    assert rc == 0, err
    assert "model small: MLP float32[n, 8] -> float32[n, 8]" in banner[1]
    assert "POST /v2/models/wide/infer" in banner[2]
    assert "POST /infer (small)" in banner[3]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "wide"], "NAME:WIDTH"),
        (["--model", "a b:8"], "NAME:WIDTH"),
        (["--model", "wide:0"], ">= 1 (got 0)"),
        (["--model", "a:8", "--model", "a:16"], "names must differ (got a twice)"),
    ],
)
def test_cli_checks_models_before_opening_devices(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hcqa.cli import main

    def no_devices(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("devices opened before the arguments were checked")

    monkeypatch.setattr(hcqa, "open_devices", no_devices)
    code: Any
    try:
        code = main(["serve", *argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert words in err


def _opencl_opens() -> str | None:
    """None when an opencl:0 device opens here, else why not."""

    async def probe() -> None:
        async with hcqa.open_devices("opencl:0"):
            pass

    try:
        trio.run(probe)
    except Exception as exc:  # an hcqa error or a missing driver: the reason is the point
        return f"{type(exc).__name__}: {exc}"
    return None


async def test_cli_serves_on_opencl_or_refuses_in_one_line() -> None:
    """Where opencl:0 opens, --device opencl serves the same MLP (OpenCL C kernels) and every
    answer matches numpy; elsewhere the command refuses in one line, exit 2, naming the option."""
    why = await trio.to_thread.run_sync(_opencl_opens)
    argv = [sys.executable, "-m", "hcqa.cli", "serve", "--port", "0", "--access-log", "none"]
    argv += ["--device", "opencl", "--model", "small:16", "--max-batch", "4"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with trio.fail_after(120):
            if why is not None:
                rc = await trio.to_thread.run_sync(proc.wait)
                _, err = proc.communicate()
                assert rc == 2, err
                assert err.count("\n") == 1, err
                assert err.startswith("hcqa: error: hcqa serve --device opencl: "), err
                return
            first = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
            match = re.search(r"http://127\.0\.0\.1:(\d+)", first)
            assert match, first
            assert "opencl:0" in first

            def check(c: Any) -> None:
                for n in (1, 3, 9):
                    x = data((n, 16), n)
                    inp = httpclient.InferInput("input", [n, 16], "FP32")
                    inp.set_data_from_numpy(x)
                    y = c.infer("small", [inp]).as_numpy("output")
                    # float32 sums in another order than BLAS's
                    np.testing.assert_allclose(y, mlp_reference(x, 16), rtol=1e-4, atol=1e-5)

            await triton(int(match.group(1)), check)
            proc.send_signal(signal.SIGTERM)
            assert await trio.to_thread.run_sync(proc.wait) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_refuses_sleep_on_opencl_before_opening_devices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hcqa.cli import main

    def no_devices(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("devices opened before the arguments were checked")

    monkeypatch.setattr(hcqa, "open_devices", no_devices)
    assert main(["serve", "--device", "opencl", "--sleep-ms", "5"]) == 2
    assert "--sleep-ms needs --device cpu" in capsys.readouterr().err


async def test_compressed_requests_as_tritonclient_sends_them() -> None:
    def check(c: Any) -> None:
        x = data((3, 5), 11)
        for algorithm in ("gzip", "deflate"):
            for binary in (False, True):
                inp = httpclient.InferInput("input", [3, 5], "FP32")
                inp.set_data_from_numpy(x, binary_data=binary)
                r = c.infer(
                    "affine",
                    [inp],
                    request_compression_algorithm=algorithm,
                    response_compression_algorithm=algorithm,  # answered uncompressed: allowed
                )
                np.testing.assert_array_equal(r.as_numpy("output"), affine_ref(x))

    async with server() as (port, _):
        await triton(port, check)


@pytest.mark.parametrize(
    ("encoding", "body", "status", "words"),
    [
        ("br", NESTED_OK, 415, ["gzip, deflate or identity", "'br'"]),
        ("gzip", NESTED_OK, 400, ["not gzip data"]),
        ("deflate", zlib.compress(NESTED_OK)[:-6], 400, ["ends early"]),
        ("gzip", gzip.compress(b" " * (2 << 20)), 413, ["larger than", "decompressed"]),
        ("identity", NESTED_OK, 200, []),
    ],
)
async def test_bad_content_encodings(
    encoding: str, body: bytes, status: int, words: list[str]
) -> None:
    async with server() as (port, _), http(port) as c:
        r = await c.post(
            "/v2/models/sums/infer", content=body, headers={"content-encoding": encoding}
        )
        assert r.status_code == status, r.content
        for word in words:
            assert word in r.json()["error"]


@pytest.mark.parametrize(
    ("headers", "body", "words"),
    [
        # '²' passes str.isdigit but not int(); 5000 digits pass isdigit but int() refuses them
        ({"inference-header-content-length": "\u00b2"}, NESTED_OK, ["Inference-Header", "'²'"]),
        ({"inference-header-content-length": "9" * 5000}, NESTED_OK, ["Inference-Header"]),
        (
            {},
            json.dumps({"parameters": {"timeout": 10**400}, "inputs": []}).encode(),
            ["'timeout'", "and <= 18446744073709551615", "(401 characters)"],
        ),
    ],
)
async def test_numbers_too_odd_for_int_or_float_are_a_400(
    headers: dict[str, str], body: bytes, words: list[str]
) -> None:
    async with server() as (port, _), http(port) as c:
        h = {k: v.encode("latin-1") for k, v in headers.items()}  # '²' is the byte 0xB2
        r = await c.post("/v2/models/sums/infer", content=body, headers=h)
        assert r.status_code == 400, r.content
        error = r.json()["error"]
        assert "Traceback" not in error
        for word in words:
            assert word in error, error
        r = await c.post("/v2/models/sums/infer", content=NESTED_OK)  # the server goes on
        assert r.status_code == 200, r.content


async def test_every_gzip_member_is_read() -> None:
    whole = json.dumps(_inp([[1, 2, 3], [4, 5, 6]], [2, 3])).encode()
    cut = len(whole) // 2
    body = gzip.compress(whole[:cut]) + gzip.compress(whole[cut:])  # what `cat a.gz b.gz` makes
    async with server() as (port, _), http(port) as c:
        r = await c.post(
            "/v2/models/sums/infer", content=body, headers={"content-encoding": "gzip"}
        )
        assert r.status_code == 200, r.content
        assert r.json()["outputs"][0]["data"] == [12.0, 30.0]
        r = await c.post(  # a bomb of several members: bounded across them all
            "/v2/models/sums/infer",
            content=gzip.compress(b" " * (1 << 20)) * 3,
            headers={"content-encoding": "gzip"},
        )
        assert r.status_code == 413, r.content
