"""``hcqa serve --model NAME=PATH.onnx``: an ONNX model served to the real tritonclient, which
gets onnxruntime's own answers; a model that fails to load fails the start in one line."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

VOCAB = 10


def _pair(path: Path) -> Path:
    """Two inputs, two outputs: ``y = relu(x @ W + B)`` (x float[N, 6]) and
    ``emb = T[ids]`` (ids int32[N, 4], an id past the table makes onnxruntime raise)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.standard_normal((6, 5)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "B"),
        numpy_helper.from_array(rng.standard_normal((VOCAB, 3)).astype(np.float32), "T"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W", "B"], ["h"]),
        helper.make_node("Relu", ["h"], ["y"]),
        helper.make_node("Gather", ["T", "ids"], ["emb"], axis=0),
    ]
    graph = helper.make_graph(
        nodes,
        "pair",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6]),
            helper.make_tensor_value_info("ids", TensorProto.INT32, ["N", 4]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5]),
            helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["N", 4, 3]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _serve(*argv: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "hcqa.cli", "serve", "--port", "0", "--access-log", "none"]
    return subprocess.Popen(
        [*cmd, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _port(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    for line in proc.stdout:
        if "serving on http://" in line:
            return int(line.split("serving on http://", 1)[1].split(" ", 1)[0].rsplit(":", 1)[1])
    raise AssertionError(f"no banner: {proc.stderr.read() if proc.stderr else ''}")


def test_tritonclient_gets_onnxruntimes_answers_from_hcqa_serve(tmp_path: Path) -> None:
    path = _pair(tmp_path / "pair.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    ids = rng.integers(0, VOCAB, (3, 4))  # int64, as token ids come: converted, they fit
    want_y, want_emb = sess.run(None, {"x": x, "ids": ids.astype(np.int32)})
    proc = _serve("--model", f"pair={path}", "--max-batch", "4")
    try:
        port = _port(proc)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")

        def infer(ids: Any) -> Any:
            xin = httpclient.InferInput("x", list(x.shape), "FP32")
            xin.set_data_from_numpy(x)
            iin = httpclient.InferInput("ids", list(ids.shape), "INT64")
            iin.set_data_from_numpy(ids, binary_data=False)
            return client.infer("pair", [xin, iin])

        result = infer(ids)
        np.testing.assert_array_equal(result.as_numpy("y"), want_y)  # onnxruntime's, bit for bit
        np.testing.assert_array_equal(result.as_numpy("emb"), want_emb)
        meta = client.get_model_metadata("pair")
        assert meta["platform"] == "onnxruntime_onnx"
        assert [(t["name"], t["shape"]) for t in meta["inputs"]] == [
            ("x", [-1, 6]),
            ("ids", [-1, 4]),
        ]
        config = client.get_model_config("pair")
        assert config["max_batch_size"] == 4
        assert config["output"][1] == {"name": "emb", "data_type": "TYPE_FP32", "dims": [4, 3]}
        bad = ids.copy()
        bad[1, 2] = VOCAB + 30  # onnxruntime refuses it: the model's InvalidCommand, a 400
        with pytest.raises(InferenceServerException) as info:
            infer(bad)
        assert info.value.status() == "400" and "idx=40" in str(info.value.message())
        result = infer(ids)  # served again: the device did not fault
        np.testing.assert_array_equal(result.as_numpy("y"), want_y)
        assert client.is_model_ready("pair")
        stats = client.get_inference_statistics("pair")["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 2
        assert stats["inference_stats"]["fail"]["count"] == 1
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        started = [line for line in err.splitlines() if line.startswith("hcqa: model pair:")]
        assert started[:5] == [  # off a terminal: one plain line per step of the start
            f"hcqa: model pair: loading {path} (onnxruntime on cpu:0)",
            "hcqa: model pair: building batch size 1 of 3",  # the sizes 1, 2 and 4
            "hcqa: model pair: building batch size 2 of 3",
            "hcqa: model pair: building batch size 3 of 3",
            "hcqa: model pair: warming up",
        ]
        assert re.fullmatch(r"hcqa: model pair: ready in \d+\.\d s", started[5])
        ours = [line for line in err.splitlines() if line.startswith("hcqa:")]
        assert "\x1b" not in out + "".join(ours)  # no control codes in a log (onnxruntime's
        # own log line for the refused input is coloured: not hcqa's to change)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_model_that_fails_to_load_fails_the_start_in_one_line(tmp_path: Path) -> None:
    good = _pair(tmp_path / "pair.onnx")
    missing = tmp_path / "gone.onnx"
    proc = _serve("--model", f"pair={good}", "--model", f"gone={missing}")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "\x1b" not in err and "failed:" not in err  # the one line below says it
    last = err.strip().splitlines()[-1]
    assert last == (
        f"hcqa: error: model 'gone' failed to load: InvalidCommand: ONNX file '{missing}' "
        "must be a readable file (got none there)"
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "a="], "NAME=PATH.onnx or NAME:WIDTH"),
        (["--model", "a b=x.onnx"], "NAME=PATH.onnx or NAME:WIDTH"),
        (
            ["--device", "opencl", "--backend", "onnxruntime", "--model", "a=x.onnx"],
            "needs --device cpu",
        ),
        (["--max-body", "0"], ">= 1 (got 0)"),
    ],
)
def test_cli_checks_onnx_models_before_opening_devices(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hcqa.cli import main

    code: Any
    try:
        code = main(["serve", *argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert words in capsys.readouterr().err
