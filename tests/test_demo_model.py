"""``hcqa demo --model squeezenet``: a real model cut over two devices by ``models.pipeline``,
every answer checked against onnxruntime, its trace written; bad flags refused in one line."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hcqa.cli import _model_demo
from hcqa.cli import main as cli_main

pytest.importorskip("tinygrad")
pytest.importorskip("onnxruntime")


def test_the_model_demo_matches_onnxruntime_and_writes_its_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.json"
    argv = ["demo", "--model", "squeezenet", "--quick", "--no-progress", "--batches", "4"]
    assert cli_main([*argv, "--depth", "2", "--trace", str(trace), "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    check = re.search(
        r"check: all 4 answers of each side vs onnxruntime, max abs error (\S+) ", out
    )
    assert check is not None, out
    assert float(check.group(1)) <= _model_demo.TOLERANCE["squeezenet"][1]
    assert out.count(": ok") == 1
    assert "pipeline, 2 devices (cpu:0, cpu:1)" in out and "speedup:" in out
    assert re.search(r"cpu:0 kernels 1-\d+ .*, cpu:1 kernels \d+-\d+ ", out), out
    assert "BLAS" not in out  # tinygrad's own kernels: the figure names no BLAS
    assert f"trace: {trace};" in out
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"
    }
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "device"]
    on = {tracks.get((e["pid"], e["tid"])) for e in kernels}
    assert {"cpu:0 compute", "cpu:1 compute"} <= on  # both devices ran the model's kernels
    regions = {e["name"] for e in events if e.get("cat") == "region"}
    assert "set-up: model built and cut" in regions and "pipeline 1-2" in regions


def test_check_refuses_an_answer_off_by_more_than_the_tolerance() -> None:
    rtol, atol = 1e-4, 1e-6
    want = [np.full((2, 5), 1e-3, np.float32), np.full((2, 5), 0.5, np.float32)]
    near = [w + np.float32(atol / 2) for w in want]
    assert _model_demo.check(near, want, rtol, atol) == (pytest.approx(atol / 2, rel=1e-3), True)
    far = [w.copy() for w in want]
    far[1][1, 3] += 0.5 * rtol + 3 * atol  # past atol + rtol * 0.5
    worst, ok = _model_demo.check(far, want, rtol, atol)
    assert not ok and worst > atol
    assert not _model_demo.check([want[0][:1], want[1]], want, rtol, atol)[1]  # a wrong shape


def test_the_gpt_stack_is_cut_over_two_devices_and_matches_onnxruntime(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--model", "gpt", "--quick", "--no-progress", "--batches", "3", "--no-trace"]
    assert cli_main([*argv, "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "a GPT-like decoder stack" in out and "3 microbatches of 1x16x128 float32" in out
    check = re.search(r"vs onnxruntime, max abs error (\S+) \(tolerance 1e-05 \+ 0.0001 x", out)
    assert check is not None and float(check.group(1)) <= 1e-5, out
    assert re.search(r"cpu:0 kernels 1-\d+ .*, cpu:1 kernels \d+-\d+ ", out), out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--model", "resnet"],
            "--model: invalid choice: 'resnet' (choose from 'squeezenet', 'gpt')",
        ),
        (["--model", "squeezenet", "--hidden", "64"], "--hidden is the MLP demo's: not with"),
        (["--model", "squeezenet", "--batches", "0"], "--batches must be >= 1 (got 0)"),
    ],
)
def test_bad_model_flags_are_one_line(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.json"
    try:
        code = cli_main(["demo", *argv, "--trace", str(trace), "--workdir", str(tmp_path)])
    except SystemExit as exc:  # argparse's refusal
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert says in line and captured.out == ""
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_without_the_models_extra_the_model_demo_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "tinygrad" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert cli_main(["demo", "--model", "squeezenet", "--no-trace"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--model needs tinygrad" in line and "pip install -e '.[models]'" in line
