"""hcqa.serve with models: their own tensor names, several inputs and outputs, dtype
conversions, anything serve() takes, recovery after a bad request, and Triton's config and
statistics endpoints.

``Stand`` is a small stand-in with the shape of ``hcqa.models.Model`` (inputs, outputs,
batch_sizes, device, name, ``async __call__``), so these tests need no compiler front end."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx
import numpy as np
import numpy.typing as npt
import pytest
import trio

import hcqa
from hcqa.serve import Model, make_app, serve
from hcqa.serve.hosted import Hosted

pytest.importorskip("starlette")
httpclient = pytest.importorskip("tritonclient.http")


@attrs.frozen
class Spec:
    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype[Any]


class Stand:
    """A two-input, two-output model: ``total = ids.sum(1) * scale``, ``ids2 = ids * 2``."""

    name = "pair"
    batch_sizes = (1, 4)

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.inputs = (
            Spec("ids", (None, 3), np.dtype(np.int32)),
            Spec("scale", (None, 1), np.dtype(np.float32)),
        )
        self.outputs = (
            Spec("total", (None, 1), np.dtype(np.float32)),
            Spec("ids2", (None, 3), np.dtype(np.int32)),
        )
        self.calls: list[int] = []

    async def __call__(self, ids: npt.NDArray[Any], scale: npt.NDArray[Any]) -> Any:
        assert ids.dtype == np.int32 and scale.dtype == np.float32
        self.calls.append(len(ids))
        await trio.lowlevel.checkpoint()
        return (ids.sum(1, keepdims=True).astype(np.float32) * scale, ids * 2)


@asynccontextmanager
async def running(what: Any, **kw: Any) -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve, what, port=0, handle_signals=False, **kw))
        yield port
        nursery.cancel_scope.cancel()


def _client(port: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)


def _infer_doc(ids: list[list[int]], scale: list[list[float]], ids_type: str = "INT32") -> Any:
    n = len(ids)
    return {
        "inputs": [
            {"name": "scale", "datatype": "FP32", "shape": [n, 1], "data": scale},
            {"name": "ids", "datatype": ids_type, "shape": [n, 3], "data": ids},
        ]
    }


async def test_a_model_is_served_under_its_own_tensor_names() -> None:
    model = Stand()
    async with running(model) as port, _client(port) as c:
        meta = (await c.get("/v2/models/pair")).json()
        assert meta["inputs"] == [
            {"name": "ids", "datatype": "INT32", "shape": [-1, 3]},
            {"name": "scale", "datatype": "FP32", "shape": [-1, 1]},
        ]
        assert [o["name"] for o in meta["outputs"]] == ["total", "ids2"]
        r = await c.post("/v2/models/pair/infer", json=_infer_doc([[1, 2, 3]], [[0.5]]))
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        assert out["total"]["data"] == [3.0] and out["total"]["shape"] == [1, 1]
        assert out["ids2"]["data"] == [2, 4, 6] and out["ids2"]["datatype"] == "INT32"
        rows = [[i, i + 1, i + 2] for i in range(6)]  # a batch of 6: chunks of 4 and 2
        r = await c.post("/v2/models/pair/infer", json=_infer_doc(rows, [[1.0]] * 6))
        assert r.status_code == 200, r.text
        total = next(o for o in r.json()["outputs"] if o["name"] == "total")
        assert total["data"] == [float(3 * i + 3) for i in range(6)]
        r = await c.post("/infer", json={"inputs": [1, 2, 3]})
        assert r.status_code == 400
        assert "/v2/models/pair/infer" in r.json()["error"]  # /infer takes one input
    assert model.calls == [1, 4, 1, 4, 2]  # warmed up once per captured size, then served


async def test_tritonclient_reads_config_and_statistics() -> None:
    model = Stand()

    def use(port: int) -> tuple[Any, Any, Any]:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        ids = httpclient.InferInput("ids", [2, 3], "INT32")
        ids.set_data_from_numpy(np.array([[1, 1, 1], [2, 2, 2]], np.int32))
        scale = httpclient.InferInput("scale", [2, 1], "FP32")
        scale.set_data_from_numpy(np.array([[1], [10]], np.float32), binary_data=True)
        result = c.infer("pair", [ids, scale])
        return result, c.get_model_config("pair"), c.get_inference_statistics("pair")

    async with running(model, max_wait=0.001) as port:
        result, config, stats = await trio.to_thread.run_sync(use, port)
    assert result.as_numpy("total").tolist() == [[3.0], [60.0]]
    assert result.as_numpy("ids2").tolist() == [[2, 2, 2], [4, 4, 4]]
    assert config["max_batch_size"] == 4
    assert config["input"] == [
        {"name": "ids", "data_type": "TYPE_INT32", "dims": [3]},
        {"name": "scale", "data_type": "TYPE_FP32", "dims": [1]},
    ]
    assert config["dynamic_batching"] == {
        "preferred_batch_size": [1, 4],
        "max_queue_delay_microseconds": 1000,
    }
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    (entry,) = stats["model_stats"]
    assert entry["name"] == "pair"
    assert entry["inference_stats"]["success"]["count"] == 1
    assert entry["inference_count"] == 2 and entry["execution_count"] == 1


async def test_int64_ids_are_converted_when_they_fit_and_refused_when_not() -> None:
    async with running(Stand()) as port, _client(port) as c:
        url = "/v2/models/pair/infer"
        r = await c.post(url, json=_infer_doc([[1, 2, 3]], [[1.0]], "INT64"))
        assert r.status_code == 200, r.text
        r = await c.post(url, json=_infer_doc([[1, 2**31, 3]], [[1.0]], "INT64"))
        assert r.status_code == 400
        error = r.json()["error"]
        assert "input 'ids'" in error and "[-2147483648, 2147483647]" in error
        assert f"[1, {2**31}]" in error
        r = await c.post(url, json=_infer_doc([[1, 2, 3]], [[1.0]], "FP64"))
        assert r.status_code == 400
        assert "expected datatype INT32" in r.json()["error"]


async def test_an_async_batch_callable_with_declared_tensors() -> None:
    async def double(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        await trio.lowlevel.checkpoint()
        return x * 2

    model = Model(
        name="double",
        pipeline=double,
        inputs=[("x", (None, 2), "float32")],
        outputs=[("y", (None, 2), "float32")],
        max_batch=8,
    )
    async with running(model) as port, _client(port) as c:
        r = await c.post("/infer", json={"inputs": [1.5, 2.0]})
        assert r.json()["outputs"] == [3.0, 4.0]
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
        r = await c.post("/v2/models/double/infer", json=doc)
        assert r.json()["outputs"][0]["name"] == "y"


@pytest.mark.parametrize(
    ("what", "words"),
    [
        (object(), "serve takes a models.Model, a Pipeline"),
        (lambda x: x, "define it with async def"),
        (Model(name="m", pipeline=Stand(), inputs=[("x", (None, 2), "float32")]), "names its own"),
    ],
)
async def test_serve_refuses_what_it_cannot_serve(what: Any, words: str) -> None:
    with pytest.raises(hcqa.InvalidCommand, match=words):
        await serve(what, port=0, handle_signals=False)


async def test_a_callable_without_tensors_and_a_symbolic_row_are_refused() -> None:
    async def f(x: Any) -> Any:
        return x

    with pytest.raises(hcqa.InvalidCommand, match="needs 'inputs' and 'outputs'"):
        await serve(f, port=0, handle_signals=False)
    model = Stand()
    model.inputs = (Spec("ids", (None, None), np.dtype(np.int32)), model.inputs[1])
    with pytest.raises(hcqa.InvalidCommand, match="'ids' dimension 1 must have a fixed size"):
        await serve(model, port=0, handle_signals=False)


async def test_a_model_that_fails_to_build_fails_the_start_naming_it() -> None:
    @asynccontextmanager
    async def broken() -> AsyncIterator[Any]:
        raise FileNotFoundError("net.onnx: no such file")
        yield  # pragma: no cover

    with pytest.raises(hcqa.InvalidCommand) as info:
        both = [Model(name="good", pipeline=Stand()), Model(name="bad", build=broken)]
        await serve(both, port=0, handle_signals=False)
    assert str(info.value) == (
        "model 'bad' failed to load: FileNotFoundError: net.onnx: no such file"
    )


async def test_health_answers_while_a_model_builds() -> None:
    release = trio.Event()
    building = trio.Event()

    @asynccontextmanager
    async def slow() -> AsyncIterator[Any]:
        building.set()
        await release.wait()
        yield Stand()

    hosted = Hosted(Model(name="slow", build=slow))
    app = make_app(hosted=[hosted])
    transport = httpx.ASGITransport(app=app)
    async with (
        trio.open_nursery() as nursery,
        httpx.AsyncClient(transport=transport, base_url="http://test") as c,
    ):
        nursery.start_soon(hosted.keep)
        await building.wait()
        r = await c.get("/health")
        assert r.status_code == 200
        assert (r.json()["status"], r.json()["models"]) == ("starting", {"slow": "building"})
        assert (await c.get("/v2/health/live")).status_code == 200
        r = await c.get("/v2/health/ready")
        assert r.status_code == 400 and "model 'slow': building" in r.json()["error"]
        r = await c.post("/v2/models/slow/infer", json=_infer_doc([[1, 2, 3]], [[1.0]]))
        assert r.status_code == 503 and "not ready (building)" in r.json()["error"]
        release.set()
        await hosted.wait_ready()
        assert (await c.get("/v2/health/ready")).status_code == 200
        assert (await c.get("/health")).json()["status"] == "ok"
        nursery.cancel_scope.cancel()


VOCAB = 10
HOLD = VOCAB - 1  # a request whose first id is this waits in the kernel for the gate


class Embedding:
    """A model whose kernel raises on an id out of its vocabulary: the device faults."""

    def __init__(self) -> None:
        self.builds: list[hcqa.Device] = []
        self.holding = threading.Event()
        self.gate = threading.Event()

    def kernel(self, out: npt.NDArray[Any], ids: npt.NDArray[Any]) -> None:
        if ids[0, 0] == HOLD:
            self.holding.set()
            self.gate.wait(30)
        bad = ids[(ids < 0) | (ids >= VOCAB)]
        if bad.size:
            raise IndexError(f"token id {int(bad[0])} is out of the vocabulary")
        out[...] = ids * 1.5

    @asynccontextmanager
    async def build(self) -> AsyncIterator[Any]:
        async with hcqa.open_device("cpu:0") as d:
            self.builds.append(d)
            program = d.program("embed", self.kernel)
            stage = hcqa.Stage(device=d, program=program, out_dtype="float32")
            yield [hcqa.Pipeline([stage], in_shape=(b, 4), dtype="int32") for b in (1, 8)]


def _ids(first: int) -> dict[str, Any]:
    return {
        "inputs": [
            {"name": "input", "datatype": "INT32", "shape": [1, 4], "data": [first, 1, 2, 3]}
        ]
    }


async def test_one_bad_request_does_not_take_the_server_down() -> None:
    """Six requests share a batch; one holds an id out of the vocabulary, so the kernel
    raises and the device faults. That request gets the error; the other five are answered
    (retried alone on a rebuilt model); the server is ready again and serves on."""
    emb = Embedding()
    model = Model(name="embed", build=emb.build, max_batch=6, max_wait=30)
    async with running(model) as port, _client(port) as c:
        url = "/v2/models/embed/infer"
        answers: dict[int, httpx.Response] = {}

        async def ask(first: int) -> None:
            answers[first] = await c.post(url, json=_ids(first))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, HOLD)  # runs alone (nothing else in flight) and holds
            await trio.to_thread.run_sync(emb.holding.wait)
            for first in (0, 1, 2, 99, 3, 4):  # a full batch of six, dispatched at once
                nursery.start_soon(ask, first)
            await _until_dispatched(c, "embed", 7)
            emb.gate.set()
        bad = answers.pop(99)
        assert bad.status_code == 500
        assert "token id 99 is out of the vocabulary" in bad.json()["error"]
        for first, r in answers.items():
            assert r.status_code == 200, (first, r.text)
            assert r.json()["outputs"][0]["data"] == [first * 1.5, 1.5, 3.0, 4.5]
        r = await c.post(url, json=_ids(5))  # waits out a rebuild still under way
        assert r.status_code == 200, r.text
        assert (await c.get("/v2/health/ready")).status_code == 200
    # the batch's fault, then the bad request's own retry alone: two rebuilds
    assert len(emb.builds) == 3
    assert all(d.closed for d in emb.builds)


async def _until_dispatched(c: httpx.AsyncClient, model: str, n: int) -> None:
    """Until the model's batcher has dispatched ``n`` single samples in its batches."""
    with trio.fail_after(30):
        while (await c.get("/stats")).json()["models"][model]["batcher"]["samples"] < n:
            await trio.sleep(0.005)


async def test_a_models_check_refuses_bad_input_before_batching() -> None:
    emb = Embedding()

    def check(inputs: Any) -> None:
        ids = inputs["input"]
        if ((ids < 0) | (ids >= VOCAB)).any():
            raise ValueError(f"ids must be in [0, {VOCAB}) (got {int(ids.max())})")

    model = Model(name="embed", build=emb.build, check=check)
    async with running(model) as port, _client(port) as c:
        r = await c.post("/v2/models/embed/infer", json=_ids(99))
        assert r.status_code == 400
        assert r.json()["error"] == (
            "model 'embed' refused the input: ids must be in [0, 10) (got 99)"
        )
        r = await c.post("/v2/models/embed/infer", json=_ids(2))
        assert r.json()["outputs"][0]["data"] == [3.0, 1.5, 3.0, 4.5]
    assert len(emb.builds) == 1


_DRAIN_CHILD = """
import sys
from functools import partial

import trio

from hcqa.serve import Model, serve

release = trio.Event()


async def double(x):
    await release.wait()
    return x * 2


async def main():
    async with trio.open_nursery() as nursery:
        async def wait_for_go():
            await trio.to_thread.run_sync(sys.stdin.readline)
            release.set()

        nursery.start_soon(wait_for_go)
        model = Model(name="m", pipeline=double, inputs=[("x", (None, 2), "float32")],
                      outputs=[("y", (None, 2), "float32")], max_batch=4)
        port = await nursery.start(partial(serve, model, port=0, grace_period=30))
        print(port, flush=True)
        # serve() returned: the server drained
    print("drained", flush=True)


trio.run(main)
"""


async def test_serve_drains_on_sigterm_by_default() -> None:
    """serve() as the docs show it -- no shutdown trigger -- on SIGTERM stops accepting and
    answers the 16 requests in flight, then returns."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with subprocess.Popen(
        [sys.executable, "-c", _DRAIN_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as child:
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None
        try:
            with trio.fail_after(60):
                port = int(await trio.to_thread.run_sync(child.stdout.readline))
            answers: list[httpx.Response] = []
            limits = httpx.Limits(max_connections=32)
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits
            ) as c:

                async def ask(k: int) -> None:
                    r = await c.post("/infer", json={"inputs": [k, k]})
                    answers.append(r)

                async with trio.open_nursery() as nursery:
                    for k in range(16):
                        nursery.start_soon(ask, k)
                    with trio.fail_after(30):
                        while (await c.get("/stats")).json()["requests_pending"] < 16:
                            await trio.sleep(0.01)
                    child.send_signal(signal.SIGTERM)
                    with trio.fail_after(30):  # the drain began: serve() logged it
                        line = await trio.to_thread.run_sync(child.stderr.readline)
                    assert "SIGTERM: draining" in line
                    child.stdin.write("go\n")
                    child.stdin.flush()
            with trio.fail_after(30):
                rest = await trio.to_thread.run_sync(child.stdout.read)
            assert rest == "drained\n"
            assert child.wait(30) == 0
        finally:
            if child.poll() is None:
                child.kill()
    assert sorted(r.json()["outputs"][0] for r in answers) == [2.0 * k for k in range(16)]
    assert all(r.status_code == 200 and r.headers["connection"] == "close" for r in answers)
