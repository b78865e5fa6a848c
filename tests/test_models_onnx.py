"""hcqa.models.load_onnx: real architectures (the onnx wheel's model zoo, seeded weights) against
onnxruntime, per batch-size buckets, on tinygrad's kernels and as one onnxruntime kernel."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _kinds import specs
from _onnx_zoo import with_weights

import hcqa

pytest.importorskip("tinygrad")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from hcqa import models  # noqa: E402

SIDE = 40  # SqueezeNet's pools still leave a 1x1 map; small enough for CI


def _ort(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    return out


def _tiny(path: Path, op: str = "Relu", domain: str = "") -> Path:
    """x[N, 6] @ W[6, 5] + b -> op: a small ONNX file with a symbolic batch."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((6, 5)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "B")
    nodes = [
        helper.make_node("Gemm", ["x", "W", "B"], ["h"], name="fc"),
        helper.make_node(op, ["h"], ["y"], name="act", domain=domain),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        [w, b],
    )
    opsets = [helper.make_opsetid("", 13)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _einsum(path: Path, equation: str) -> Path:
    """relu(x[N, 6]) then Einsum ``equation`` with W[6, 5]: tinygrad's front end knows the
    operator but fails on some equations (an output letter repeated: an IndexError)."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((6, 5), np.float32), "W")
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="pre"),
        helper.make_node("Einsum", ["h", "W"], ["y"], name="mix", equation=equation),
    ]
    graph = helper.make_graph(
        nodes,
        "einsum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def squeezenet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_weights("squeezenet", tmp_path_factory.mktemp("zoo"), batch=True, side=SIDE)


async def test_squeezenet_on_tinygrads_kernels_matches_onnxruntime_per_bucket(
    squeezenet: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hcqa.models import cache

    monkeypatch.setattr(cache, "load", lambda key: None)  # always capture through tinygrad
    async with hcqa.open_devices("cpu:0") as (dev,):
        m = await models.load_onnx(squeezenet, device=dev, batch_sizes=(2, 1))
        assert multiprocessing.active_children() == []  # tinygrad's compiler pool ended
        assert m.batch_sizes == (1, 2)
        assert m.inputs == (models.TensorSpec("data_0", (None, 3, SIDE, SIDE), np.float32),)
        assert m.outputs == (models.TensorSpec("softmaxout_1", (None, 1000, 1, 1), np.float32),)
        rng = np.random.default_rng(5)
        x = rng.standard_normal((2, 3, SIDE, SIDE)).astype(np.float32)
        want = _ort(squeezenet, x)
        assert want[0].std() > 1e-4  # the seeded weights give a real, not a flat, answer
        np.testing.assert_allclose(await m(x), want, rtol=1e-5, atol=1e-7)
        y1 = await m(x[1:])  # bucket 1
        np.testing.assert_allclose(y1, want[1:], rtol=1e-5, atol=1e-7)
        st = m.statistics()
        assert st.calls == 2 and st.rows_padded == 0 and st.kernels > 26  # 26 convolutions
        with pytest.raises(hcqa.InvalidCommand, match=r"batch size must be in \[1, 2\] \(got 3\)"):
            await m(np.concatenate([x, x[:1]]))
        with pytest.raises(hcqa.InvalidCommand, match=r"batch size must be in \[1, 2\] \(got 0\)"):
            await m(x[:0])
        with pytest.raises(hcqa.InvalidCommand, match=r"'data_0' must have shape \(N, 3, 40, 40\)"):
            await m(x[:, :, :20])
        np.testing.assert_allclose(await m(x), want, rtol=1e-5, atol=1e-7)  # still answers


async def test_squeezenet_as_one_onnxruntime_kernel_is_onnxruntimes_answer(
    squeezenet: Path,
) -> None:
    async with hcqa.open_devices("cpu:0") as (dev,):
        m = await models.load_onnx(
            squeezenet, device=dev, backend="onnxruntime", batch_sizes=(1, 4)
        )
        x = np.random.default_rng(6).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)
        want = _ort(squeezenet, x)
        got = await m(x)  # 3 rows padded into the bucket of 4
        assert got.shape == (3, 1000, 1, 1)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
        assert m.statistics().rows_padded == 1 and m.statistics().kernels == 1
        np.testing.assert_allclose(await m(x[:1]), want[:1], rtol=1e-6, atol=1e-8)


async def test_a_small_onnx_model_on_each_kind(kind: str, tmp_path: Path) -> None:
    path = _tiny(tmp_path / "tiny.onnx")
    async with hcqa.open_devices(*specs(kind)) as (dev,):
        m = await models.load_onnx(path, device=dev, batch_sizes=(1, 4))
        x = np.random.default_rng(8).standard_normal((3, 6)).astype(np.float32)
        want = _ort(path, x)
        np.testing.assert_allclose(await m(x), want, rtol=1e-5, atol=1e-6)
        assert m.outputs == (models.TensorSpec("y", (None, 5), np.float32),)
        assert m.backend == "tinygrad"


async def test_bad_onnx_input_is_refused_by_name(tmp_path: Path) -> None:
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x08\x07not a model at all" * 20)
    custom = _tiny(tmp_path / "custom.onnx", op="Frobnicate", domain="com.example")
    async with hcqa.open_devices("cpu:0", *specs("opencl") if _cl() else ()) as devs:
        dev = devs[0]
        with pytest.raises(hcqa.InvalidCommand, match=r"junk.onnx' is not an ONNX model"):
            await models.load_onnx(junk, device=dev)
        with pytest.raises(hcqa.InvalidCommand, match="must be a readable file"):
            await models.load_onnx(tmp_path / "missing.onnx", device=dev)
        with pytest.raises(hcqa.InvalidCommand, match=r"node 1 \(act\): operator 'Frobnicate'"):
            await models.load_onnx(custom, device=dev)
        einsum = _einsum(tmp_path / "einsum.onnx", "ij,jk->ikk")  # known, but fails to lower
        with pytest.raises(
            hcqa.InvalidCommand,
            match=r"einsum.onnx' node 1 \(mix\): operator 'Einsum' can't be lowered .*IndexError",
        ):
            await models.load_onnx(einsum, device=dev, batch_sizes=(2,))
        with pytest.raises(hcqa.InvalidCommand, match="'backend' must be one of"):
            await models.load_onnx(custom, device=dev, backend="tvm")
        with pytest.raises(hcqa.InvalidCommand, match=r"'batch_sizes' must be ints >= 1"):
            await models.load_onnx(custom, device=dev, batch_sizes=(0, 2))
        if len(devs) > 1:
            with pytest.raises(hcqa.InvalidCommand, match="runs as a Python kernel on cpu:N"):
                await models.load_onnx(custom, device=devs[1], backend="onnxruntime")
        good = await models.load_onnx(_tiny(tmp_path / "ok.onnx"), device=dev, batch_sizes=(2,))
        x = np.ones((2, 6), np.float32)
        np.testing.assert_allclose(await good(x), _ort(tmp_path / "ok.onnx", x), rtol=1e-5)


def _cl() -> Any:
    from _kinds import opencl_missing

    return opencl_missing() is None


async def test_a_second_load_reuses_the_capture_and_a_damaged_entry_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hcqa.models import _tinygrad

    monkeypatch.setenv("HCQA_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny(tmp_path / "tiny.onnx")
    x = np.random.default_rng(9).standard_normal((2, 6)).astype(np.float32)
    want = _ort(path, x)
    real = _tinygrad.locked_onnx_capture
    runs: list[Any] = []

    def counted(*args: Any, **kw: Any) -> Any:
        runs.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(_tinygrad, "locked_onnx_capture", counted)
    async with hcqa.open_devices("cpu:0") as (dev,):
        first = await models.load_onnx(path, device=dev, batch_sizes=(2,))
        assert len(runs) == 1
        second = await models.load_onnx(path, device=dev, batch_sizes=(2,))
        assert len(runs) == 1  # from the cache: tinygrad did not run
        np.testing.assert_array_equal(await second(x), await first(x))
        np.testing.assert_allclose(await second(x), want, rtol=1e-5, atol=1e-6)
        entries = list((tmp_path / "cache").glob("*.lifted"))
        assert len(entries) == 1
        entries[0].write_bytes(entries[0].read_bytes()[:200])  # truncated: a miss, recaptured
        third = await models.load_onnx(path, device=dev, batch_sizes=(2,))
        assert len(runs) == 2
        np.testing.assert_allclose(await third(x), want, rtol=1e-5, atol=1e-6)
        await models.load_onnx(path, device=dev, batch_sizes=(1,))  # another shape: another key
        assert len(runs) == 3


async def test_an_input_onnxruntime_refuses_is_the_callers_error_not_the_devices(
    tmp_path: Path,
) -> None:
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.arange(30, dtype=np.float32).reshape(10, 3), "E")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["y"])],
        "lookup",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 3])],
        [table],
    )
    path = tmp_path / "lookup.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    async with hcqa.open_devices("cpu:0") as (dev,):
        m = await models.load_onnx(path, device=dev, backend="onnxruntime", batch_sizes=(2,))
        assert m.backend == "onnxruntime"
        ids = np.array([[1, 2], [3, 99]], np.int64)  # 99: out of the table's range
        with pytest.raises(hcqa.InvalidCommand, match=r"model 'lookup' could not run this input"):
            await m(ids)
        ids[1, 1] = 4
        np.testing.assert_array_equal(await m(ids), np.arange(30.0).reshape(10, 3)[ids])
        await dev.synchronize()  # the device did not fault


@pytest.mark.parametrize("backend", ["tinygrad", "onnxruntime"])
def test_a_model_loads_and_runs_under_asyncio(backend: str, tmp_path: Path) -> None:
    """``await m(x)`` from asyncio code (models route through hcqa.aio): loaded, run and
    closed under ``asyncio.run``, with onnxruntime's answers."""
    path = _tiny(tmp_path / "tiny.onnx")
    x = np.random.default_rng(9).standard_normal((3, 6)).astype(np.float32)

    async def main() -> tuple[np.ndarray, np.ndarray, str]:
        async with hcqa.open_device("cpu:0") as dev:
            m = await models.load_onnx(path, device=dev, backend=backend, batch_sizes=(1, 4))
            both = await asyncio.gather(m(x), m(x[:1]))  # two asyncio tasks, one model
            return both[0], both[1], m.backend

    got, first, used = asyncio.run(asyncio.wait_for(main(), 60))
    want = _ort(path, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(first, want[:1], rtol=1e-5, atol=1e-6)
    assert used == backend
