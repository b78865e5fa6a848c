"""``hcqa demo``: its verdict line, its trace options, and an honest ``--processes`` mode."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from hcqa.cli import demo
from hcqa.cli import main as cli_main

V = {"cores": 2, "load": 0.5, "blas_limited": True}


@pytest.mark.parametrize(
    ("kw", "expect"),
    [
        ({"t_pipe": 0.007, "t_seq": 0.006}, "verdict: too short to judge (7 ms vs 6 ms"),
        ({"t_pipe": 0.2, "t_seq": 0.9}, "too short to judge"),  # a win, but too short to count
        ({"t_pipe": 2.0, "t_seq": 3.2}, "verdict: the pipeline did 1.60x the 1-device"),
        ({"t_pipe": 2.0, "t_seq": 2.0}, "verdict: the pipeline did 1.00x"),
        ({"t_pipe": 2.0, "t_seq": 1.8, "cores": 1}, "lost (0.90x): only 1 core is available"),
        ({"t_pipe": 2.0, "t_seq": 1.8, "blas_limited": False}, "BLAS threads are not limited"),
        ({"t_pipe": 2.0, "t_seq": 1.8, "load": 3.6}, "busy (1-minute load average 3.6 on 2"),
        ({"t_pipe": 2.0, "t_seq": 1.8, "load": None}, "handing each microbatch between devices"),
        ({"t_pipe": 2.0, "t_seq": 1.8, "processes": True}, "between worker processes"),
        (
            {"t_pipe": 2.0, "t_seq": 1.8, "shared_device": "opencl:0"},
            "lost (0.90x): both stages ran on one OpenCL device (opencl:0 named twice)",
        ),
        (
            {"t_pipe": 2.0, "t_seq": 2.1, "shared_device": "opencl:0"},
            "did 1.05x the 1-device throughput; both stages ran on one OpenCL device",
        ),
    ],
)
def test_the_verdict_says_what_the_speedup_means(kw: dict[str, Any], expect: str) -> None:
    line = demo.verdict(**{**V, **kw})
    assert expect in line and "\n" not in line


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli_main(["demo", "--quick", "--no-progress", *argv]) == 0
    return capsys.readouterr().out


def test_a_quick_run_says_it_is_too_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(["--trace", str(tmp_path / "t.json"), "--workdir", str(tmp_path)], capsys)
    (line,) = [line for line in out.splitlines() if "verdict:" in line]
    assert "too short to judge" in line and "--quick" in line
    assert "speedup:" in out


def test_no_trace_writes_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HCQA_TRACE", str(tmp_path / "env.json"))
    out = _run(["--no-trace", "--workdir", str(tmp_path / "w")], capsys)
    assert "trace: not written (--no-trace)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def test_trace_goes_where_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HCQA_TRACE", raising=False)
    where = tmp_path / "sub" / "mine.json"
    where.parent.mkdir()
    out = _run(["--trace", str(where), "--workdir", str(tmp_path / "w")], capsys)
    assert f"trace: {where};" in out and where.stat().st_size > 0
    assert not (tmp_path / "hcqa-demo-trace.json").exists()
    names = {e.get("args", {}).get("name") for e in json.loads(where.read_text())["traceEvents"]}
    assert {"pipeline 1-4 worker 1", "sequential 5-8 worker 1"} <= names  # named tasks


def test_trace_and_no_trace_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["demo", "--quick", "--trace", "x.json", "--no-trace"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_without_threadpoolctl_the_demo_runs_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    out = _run(["--no-trace", "--workdir", str(tmp_path)], capsys)
    assert "BLAS threads NOT limited (pip install -e '.[demo]'" in out and ": ok" in out


def test_processes_mode_is_honest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It says what ran, and its 1-device baseline runs on a device (in the trace, off the
    event loop) instead of blocking the loop."""
    trace = tmp_path / "p.json"
    argv = ["--processes", "--hidden", "256", "--batch-size", "64", "--batches", "8"]
    out = _run([*argv, "--trace", str(trace), "--workdir", str(tmp_path)], capsys)
    assert "2 devices" not in out
    assert "pipeline, 2 worker processes" in out and "sequential, 1 device (cpu:0)" in out
    assert "which this trace does not see" in out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"
    }
    baseline = [e for e in events if e.get("ph") == "X" and e.get("name") == "mlp"]
    assert len(baseline) == 8 + 6  # every timed and warm-up microbatch ran as a device range...
    # ... on the device's compute engine (a thread), not in a trio task step on the event loop
    assert {names[e["pid"], e["tid"]] for e in baseline} == {"cpu:0 compute"}
    assert {e["cat"] for e in baseline} == {"device"}


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_display_draws_only_on_a_terminal() -> None:
    from hcqa.cli._console import progress

    pipe = io.StringIO()
    with progress("warming up", 4, stream=pipe) as bar:
        bar.advance()
        bar.describe("pipeline 1-2")
    assert pipe.getvalue() == ""
    tty = _Tty()
    with progress("warming up", 4, stream=tty) as bar:
        bar.advance(2)
        bar.describe("pipeline 1-2")
    drawn = tty.getvalue()
    assert "pipeline 1-2" in drawn and "2/4" in drawn
    with progress("off", 4, stream=tty, enabled=False):
        pass
    assert tty.getvalue() == drawn  # disabled: nothing more written


def test_a_full_run_warms_up_then_says_what_the_figure_depends_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not --quick: the warm-up repeats until each side has run WARM_SECONDS (tiny sizes here,
    # so it runs all its passes), and the output explains the speedup it prints.
    trace = tmp_path / "t.json"
    argv = ["--batches", "8", "--batch-size", "16", "--hidden", "64", "--depth", "2"]
    assert cli_main(["demo", "--no-progress", *argv, "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    halves = r"A B B A after a warm-up, halves [\d.]+x and [\d.]+x\)"
    assert re.search(r"speedup: [\d.]+x \(.*" + halves, out), out
    assert "the figure depends on free cores" in out and "BLAS threads (1 per device)" in out
    assert "load average" in out
    events = json.loads(trace.read_text())["traceEvents"]
    whole = [e for e in events if e.get("ph") == "X" and e.get("name") == "mlp"]
    warm = 2 * 2  # 2 * depth microbatches a pass
    assert len(whole) == 8 + warm * demo.WARM_PASSES  # every warm-up pass ran


def test_opencl_without_pyopencl_fails_before_writing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """No weights file, no trace: the previous trace stays; the error is one line with the
    install hint."""
    monkeypatch.setitem(sys.modules, "pyopencl", None)
    trace = tmp_path / "t.json"
    trace.write_text('{"previous": "good"}')
    argv = ["demo", "--quick", "--device", "opencl", "--no-progress", "--trace", str(trace)]
    assert cli_main([*argv, "--workdir", str(tmp_path / "w")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert "--device opencl needs PyOpenCL" in line and "pip install -e '.[opencl]'" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]
    assert trace.read_text() == '{"previous": "good"}'


def test_a_failed_run_keeps_the_previous_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The trace is written beside its path and renamed onto it only once the run finished:
    a run that fails leaves the previous trace as it was, and no partial file."""
    trace = tmp_path / "t.json"
    trace.write_text('{"previous": "good"}')

    async def fails(*args: Any) -> Any:
        import trio

        await trio.sleep(0)
        raise RuntimeError("a stage failed")

    monkeypatch.setattr(demo, "run_threads", fails)
    argv = ["demo", "--quick", "--no-progress", "--trace", str(trace)]
    assert cli_main([*argv, "--workdir", str(tmp_path / "w")]) != 0
    assert "a stage failed" in capsys.readouterr().err
    assert trace.read_text() == '{"previous": "good"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "w"]
    monkeypatch.undo()
    out = _run(["--trace", str(trace), "--workdir", str(tmp_path / "w")], capsys)
    assert f"trace: {trace};" in out and "traceEvents" in trace.read_text()


def test_the_opencl_figure_names_no_blas() -> None:
    said = demo.depends(cores=2, blas_limited=False, load=1.0, shared_device="opencl:0")
    assert "BLAS" not in said and "opencl:0's compute units" in said
    assert "BLAS threads (1 per device)" in demo.depends(cores=2, blas_limited=True, load=1.0)
