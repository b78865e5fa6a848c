"""hcqa.models.from_tinygrad: tinygrad functions lifted into captured hcqa graphs.

Every model test compares with tinygrad's own answer on the same inputs: bit for bit (the same
source compiled with the same flags), on cpu:N and on opencl:N (PoCL).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from typing import Any

import numpy as np
import pytest
import trio
from _kinds import specs

import hcqa

pytest.importorskip("tinygrad")
from hcqa import models


def _mlp(where: str, seed: int = 0) -> tuple[Any, np.ndarray]:
    from tinygrad import Tensor

    rng = np.random.default_rng(seed)
    w1 = Tensor(rng.standard_normal((64, 96)).astype(np.float32), device=where).realize()
    b1 = Tensor(rng.standard_normal(96).astype(np.float32), device=where).realize()
    w2 = Tensor(rng.standard_normal((96, 10)).astype(np.float32), device=where).realize()

    def forward(x: Any) -> Any:
        return ((x @ w1 + b1).relu() @ w2).softmax(-1)

    return forward, rng.standard_normal((8, 64)).astype(np.float32)


def _reference(fn: Any, where: str, *arrays: np.ndarray, **kw: Any) -> np.ndarray:
    from tinygrad import Tensor

    out: np.ndarray = fn(*(Tensor(a, device=where) for a in arrays), **kw).numpy()
    return out


async def test_a_tinygrad_mlp_gives_tinygrads_answer_bit_for_bit(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind)) as (dev,):
        where = models.tinygrad_device(dev)
        assert where == {"cpu": "CPU", "opencl": "CL"}[kind]
        forward, x = _mlp(where)
        m = await models.from_tinygrad(forward, [x], device=dev)
        assert m.inputs == (models.TensorSpec("input_0", (8, 64), np.float32),)
        assert m.outputs == (models.TensorSpec("output_0", (8, 10), np.float32),)
        assert m.batch_sizes == () and isinstance(m.graph, hcqa.Graph) and m.device is dev
        for seed in range(3):
            x = np.random.default_rng(seed + 10).standard_normal((8, 64)).astype(np.float32)
            y = await m(x)
            assert y.dtype == np.float32 and y.shape == (8, 10)
            np.testing.assert_array_equal(y, _reference(forward, where, x))
        st = m.statistics()
        assert st.calls == 3 and st.kernels >= 2 and st.programs >= 2
        assert st.weight_bytes >= (64 * 96 + 96 + 96 * 10) * 4


async def test_the_process_keeps_its_c_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """$CC is set to a clang only around tinygrad's capture and the builds of its C."""
    import os

    monkeypatch.delenv("CC", raising=False)
    async with hcqa.open_devices("cpu:0") as (dev,):
        forward, x = _mlp(models.tinygrad_device(dev), seed=4)
        m = await models.from_tinygrad(forward, [x], device=dev)
        assert "CC" not in os.environ
        assert (await m(x)).shape == (8, 10)
        monkeypatch.setenv("CC", "cc")  # the user's own stays theirs
        models.tinygrad_device(dev)
        assert os.environ["CC"] == "cc"


async def test_bad_inputs_are_refused_before_anything_is_queued_and_it_still_answers() -> None:
    async with hcqa.open_devices("cpu:0") as (dev,):
        where = models.tinygrad_device(dev)
        forward, x = _mlp(where)
        m = await models.from_tinygrad(forward, [x], device=dev)
        good = await m(x)
        before = m.graph.statistics()
        bad: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
            ((x.astype(np.float64),), {}, "must have dtype float32 (got float64)"),
            ((x[:4],), {}, "must have shape (8, 64) (got (4, 64))"),
            ((x.reshape(-1),), {}, "must have shape (8, 64) (got (512,))"),
            ((x.astype(object),), {}, "must have dtype float32 (got object)"),
            ((x.tolist(),), {}, "must be a numpy ndarray (got list)"),
            ((), {}, "takes 1 input(s) (input_0) (got 0)"),
            ((x, x), {}, "takes 1 input(s) (input_0) (got 2)"),
            ((x,), {"start_pos": 3}, "takes variables [] (got ['start_pos'])"),
        ]
        for args, kw, msg in bad:
            with pytest.raises(hcqa.InvalidCommand) as info:
                await m(*args, **kw)
            assert msg in str(info.value)
        assert m.graph.statistics() == before  # nothing was replayed
        x[0, 0] = np.nan
        y = await m(x)  # NaN is data, not an error: it flows as tinygrad's own kernels let it
        np.testing.assert_array_equal(y, _reference(forward, where, x))
        np.testing.assert_array_equal(y[1:], good[1:])  # the other rows are untouched
        x[0, 0] = 0.5
        np.testing.assert_array_equal(await m(x[:]), _reference(forward, where, x))
        assert good.shape == (8, 10)


async def test_from_tinygrad_refuses_what_it_cannot_lift() -> None:
    async with hcqa.open_devices("cpu:0") as (dev,):
        where = models.tinygrad_device(dev)
        forward, x = _mlp(where)
        with pytest.raises(hcqa.InvalidCommand, match="example input 0 must be a numpy ndarray"):
            await models.from_tinygrad(forward, [x.tolist()], device=dev)
        with pytest.raises(hcqa.InvalidCommand, match="native bool, int or float dtype"):
            await models.from_tinygrad(forward, [x.astype(object)], device=dev)
        with pytest.raises(hcqa.InvalidCommand, match="must be a list or tuple"):
            await models.from_tinygrad(forward, x, device=dev)  # type: ignore[arg-type]
        with pytest.raises(hcqa.InvalidCommand, match="tinygrad could not run the function"):
            await models.from_tinygrad(lambda a: a @ a, [x], device=dev)  # (8,64) @ (8,64)
        with pytest.raises(hcqa.InvalidCommand, match=r"must return a tinygrad Tensor"):
            await models.from_tinygrad(lambda a: 3, [x], device=dev)
        with pytest.raises(hcqa.InvalidCommand, match=r"\(lo, hi\) pair of ints"):
            await models.from_tinygrad(forward, [x], device=dev, variables={"n": (0, 1.5)})
        with pytest.raises(hcqa.InvalidCommand, match=r"0 <= lo <= hi < 2\*\*31"):
            await models.from_tinygrad(forward, [x], device=dev, variables={"n": (5, 1)})
        m = await models.from_tinygrad(forward, [x], device=dev)  # still fine afterwards
        np.testing.assert_array_equal(await m(x), _reference(forward, where, x))


async def test_a_kernel_split_over_cpu_cores_runs_once_per_core_id() -> None:
    """tinygrad's CPU device splits a large kernel over its threads (a ``core_id`` parameter,
    called once per thread): hcqa launches it once per core_id, in one graph."""
    from tinygrad import Tensor

    from hcqa.models import _tinygrad

    async with hcqa.open_devices("cpu:0") as (dev,):
        where = models.tinygrad_device(dev)
        rng = np.random.default_rng(2)
        w = Tensor(rng.standard_normal((256, 512)).astype(np.float32), device=where).realize()

        def forward(x: Any) -> Any:
            return (x @ w).relu()

        x = rng.standard_normal((64, 256)).astype(np.float32)
        lifted = _tinygrad.locked_capture(forward, [x], kind="cpu", variables={}, names=["x"])
        split = [k for k in lifted.kernels if k.core_id is not None]
        if not split:
            pytest.skip("tinygrad uses one CPU thread here: no kernel counts core_id")
        assert all(k.launches > 1 for k in split)
        m = await models.from_tinygrad(forward, [x], device=dev)
        assert m.statistics().kernels == sum(k.launches for k in lifted.kernels)
        x2 = rng.standard_normal((64, 256)).astype(np.float32)  # not the capture's example
        np.testing.assert_array_equal(await m(x2), _reference(forward, where, x2))


def test_another_tinygrad_version_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    from hcqa.models import _tinygrad

    real = importlib.metadata.version

    def fake(name: str) -> str:
        return "0.13.0" if name == "tinygrad" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", fake)
    with pytest.raises(hcqa.InvalidCommand) as info:
        _tinygrad._check_version()
    assert "tinygrad 0.14.0 only (got tinygrad 0.13.0)" in str(info.value)
    monkeypatch.setattr(importlib.metadata, "version", real)
    _tinygrad._check_version()


async def test_a_decoder_with_a_kv_cache_generates_tinygrads_tokens(kind: str) -> None:
    """A one-layer causal decoder: token in, next token out, KV cache in tinygrad buffers the
    graph writes at ``start_pos``; greedy generation from the replayed graph equals tinygrad's
    own generation (its TinyJit) token for token."""
    from tinygrad import Tensor, TinyJit, Variable

    vocab, dim, ctx = 32, 16, 12
    async with hcqa.open_devices(*specs(kind)) as (dev,):
        where = models.tinygrad_device(dev)
        rng = np.random.default_rng(7)

        def weights(*shape: int) -> Any:
            return Tensor(rng.standard_normal(shape).astype(np.float32) * 0.5, device=where)

        emb, wq, wk, wv, wo = (
            weights(vocab, dim),
            *(weights(dim, dim) for _ in range(3)),
            weights(dim, vocab),
        )
        for w in (emb, wq, wk, wv, wo):
            w.realize()

        def decoder() -> Any:
            ck = Tensor.zeros(ctx, dim, device=where).contiguous().realize()
            cv = Tensor.zeros(ctx, dim, device=where).contiguous().realize()

            def step(tok: Any, start_pos: Any) -> Any:
                h = emb[tok]  # (1, dim)
                ck[start_pos : start_pos + 1].assign(h @ wk).realize()
                cv[start_pos : start_pos + 1].assign(h @ wv).realize()
                keys, values = ck[: start_pos + 1], cv[: start_pos + 1]
                att = ((h @ wq) @ keys.T / dim**0.5).softmax(-1)
                logits = (h + att @ values) @ wo
                return logits.argmax(-1).cast("int32")

            return step

        m = await models.from_tinygrad(
            decoder(), [np.array([0], np.int32)], device=dev, variables={"start_pos": (0, ctx - 1)}
        )
        assert [v.name for v in m.variables] == ["start_pos"]
        ref_step = TinyJit(decoder())
        sp = Variable("start_pos", 0, ctx - 1)
        ours, theirs = [3], [3]
        for pos in range(ctx - 1):
            t = ref_step(
                Tensor(np.array([theirs[-1]], np.int32), device=where), start_pos=sp.bind(pos)
            )
            theirs.append(int(t.numpy()[0]))
            got = await m(np.array([ours[-1]], np.int32), start_pos=pos)
            ours.append(int(got[0]))
        assert ours == theirs
        assert len(set(ours)) > 2  # a real sequence, not one token repeated
        with pytest.raises(hcqa.InvalidCommand, match="start_pos"):
            await m(np.array([1], np.int32), start_pos=ctx)  # out of its range
        with pytest.raises(hcqa.InvalidCommand, match=r"takes variables \['start_pos'\]"):
            await m(np.array([1], np.int32))
        await m(np.array([ours[-1]], np.int32), start_pos=ctx - 1)  # still answers


def test_the_zig_wrapper_compiles_tinygrads_c(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no clang is installed, the ziglang wheel's ``zig cc`` behind hcqa's wrapper
    compiles tinygrad's C, bare-metal target triple included."""
    import subprocess

    from hcqa.models import _toolchain

    monkeypatch.setenv("HCQA_CACHE_DIR", str(tmp_path / "cache"))
    cc = _toolchain.zig_wrapper()
    if cc is None:
        pytest.skip("the ziglang wheel is not installed")
    src = (
        "typedef float float4 __attribute__((aligned(16),ext_vector_type(4)));\n"
        "void k(float* restrict a, int n) { float4 v = *((float4*)a); float s = 0.5f;\n"
        "  for (int i = 0; i < n; i++) s += a[i] * 1.25f; a[0] = v[1] + v[2] + s; }\n"
    )
    r = subprocess.run(
        [
            cc,
            "-c",
            "-x",
            "c",
            "-O2",
            "-fPIC",
            "-ffreestanding",
            "-nostdlib",
            "--target=x86_64-none-unknown-elf",
            "-",
            "-o",
            "-",
        ],
        input=src.encode(),
        capture_output=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout[:4] == b"\x7fELF"
    importlib.import_module("hcqa.models._tinygrad")  # sets tinygrad's environment first
    from tinygrad.runtime.support.elf import jit_loader

    assert len(jit_loader(r.stdout)) > 0  # tinygrad's own loader takes it (no debug relocations)


_FIRST_TOUCH = {
    # a user's own weights put on hcqa's tinygrad device
    "weights": (
        "        where = models.tinygrad_device(dev)\n"
        "        x = Tensor(np.arange(12, dtype=np.float32).reshape(2, 6), device=where)\n"
        "        print(json.dumps((x * 2 + 1).numpy().tolist()))\n"
    ),
    # an ONNX model on tinygrad: its runner's constants open tinygrad's CPU device
    "onnx": (
        "        m = await models.load_onnx(sys.argv[1], device=dev, batch_sizes=(2,))\n"
        "        x = np.arange(12, dtype=np.float32).reshape(2, 6)\n"
        "        print(json.dumps((await m(x)).tolist()))\n"
    ),
}


@pytest.mark.parametrize("first", sorted(_FIRST_TOUCH))
def test_tinygrad_compiles_with_the_zig_wrapper_whatever_touched_it_first(
    tmp_path: Any, first: str
) -> None:
    """On a machine whose only clang is the ziglang wheel, tinygrad read ``$CC`` before hcqa
    did (a user's own tinygrad code ran first: its cached default is a ``clang`` that is not
    there); hcqa's tinygrad device still compiles (with the wrapper), whether a user's weights
    or an ONNX model's runner opens tinygrad's CPU device first (it compiles helper programs
    when it opens). Run in a child whose PATH holds no compiler, as on such a machine; the
    answers are checked against numpy's and onnxruntime's."""
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("ziglang") is None:
        pytest.skip("the ziglang wheel is not installed")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "W", "B"], ["h"], name="fc"),
            helper.make_node("Relu", ["h"], ["y"], name="act"),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / "tiny.onnx"
    path.write_bytes(model.SerializeToString())
    script = (
        "import json, sys\n"
        "import numpy as np\n"
        "from tinygrad import helpers\n"
        "assert helpers.getenv('CC', 'clang') == 'clang'  # read before hcqa, and cached\n"
        "import trio\n"
        "import hcqa\n"
        "from hcqa import models\n"
        "from tinygrad import Tensor\n"
        "async def main():\n"
        "    async with hcqa.open_devices('cpu:0') as (dev,):\n"
        f"{_FIRST_TOUCH[first]}"
        "trio.run(main)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "PATH", "PYTHONPATH")}
    env["PATH"] = str(tmp_path)  # nothing there: no clang, no gcc
    env["HCQA_CACHE_DIR"] = str(tmp_path / "cache")
    env["CACHEDB"] = str(tmp_path / "tinygrad.db")  # compiles, not tinygrad's cached binaries
    r = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.array(json.loads(r.stdout.splitlines()[-1]), np.float32)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    if first == "onnx":
        import onnxruntime as ort

        want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, x * 2 + 1)


async def test_a_cancelled_call_leaves_the_model_answering() -> None:
    async with hcqa.open_devices("cpu:0") as (dev,):
        where = models.tinygrad_device(dev)
        forward, x = _mlp(where)
        m = await models.from_tinygrad(forward, [x], device=dev)
        want = _reference(forward, where, x)
        for _ in range(5):
            with trio.move_on_after(0):
                await m(x)
            with trio.CancelScope() as scope:
                scope.cancel()
                await m(x * 2)
        np.testing.assert_array_equal(await m(x), want)


async def test_concurrent_calls_each_get_their_own_answer(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind)) as (dev,):
        where = models.tinygrad_device(dev)
        forward, x = _mlp(where)
        m = await models.from_tinygrad(forward, [x], device=dev)
        xs = [np.random.default_rng(100 + i).standard_normal((8, 64)).astype(np.float32)
              for i in range(12)]  # fmt: skip
        want = [_reference(forward, where, a) for a in xs]
        got: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            got[i] = await m(xs[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(xs)):
                nursery.start_soon(one, i)
        for i in range(len(xs)):
            np.testing.assert_array_equal(got[i], want[i])
        assert m.statistics().calls == len(xs)
