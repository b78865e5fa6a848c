"""``hcqa demo --device opencl`` run as a user runs it: the MLP as OpenCL kernels over two
hcqa devices on ``opencl:0``, checked against numpy, traced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _kinds import opencl_missing

BIN = Path(sys.executable).parent


def _demo(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = BIN / "hcqa"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hcqa.cli"]
    return subprocess.run(
        [*command, "demo", *argv], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_bad_opencl_options_are_one_line(tmp_path: Path) -> None:
    for argv, says in (
        (["--batch-size", "20"], "--batch-size must be a multiple of 16 with --device opencl"),
        (["--processes"], "--processes runs numpy stages"),
    ):
        proc = _demo("--quick", "--device", "opencl", *argv, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(opencl_missing() is not None, reason=str(opencl_missing()))
def test_demo_on_two_opencl_devices_matches_numpy_and_traces_the_kernels(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    proc = _demo(
        "--quick", "--device", "opencl", "--no-progress", "--trace", str(trace),
        "--workdir", str(tmp_path / "w"), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    (check,) = [line for line in out.splitlines() if "check:" in line]
    assert check.rstrip().endswith("ok") and "vs numpy" in check
    assert "pipeline, 2 OpenCL devices (opencl:0, " in out
    assert "4 OpenCL kernel stages" in out
    assert "BLAS" not in out  # no BLAS runs the stages: no line about its threads
    events = json.loads(trace.read_text())["traceEvents"]
    pids = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    cl_pids = {pid for pid, name in pids.items() if name.startswith("opencl:0")}
    assert len(cl_pids) == 2, pids  # two hcqa devices on the one OpenCL device
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "device"]
    layers = {e["name"] for e in ranges if e["pid"] in cl_pids}
    assert "layer" in layers or any(n.startswith("layer") for n in layers), layers
    assert {e["pid"] for e in ranges if e["name"].startswith("layer")} == cl_pids
