"""Reading a trace as a user does: stable colours, regions that say which part is which,
zooming into a sparse (server) trace, and where to go for an interactive view."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import hcqa
from hcqa import cli
from hcqa.trace import Tracer, region

pytest.importorskip("matplotlib")


def _trace(
    programs: list[tuple[str, float, float]], regions: tuple[tuple[str, float, float], ...] = ()
) -> dict[str, Any]:
    """A trace with one device queue running ``programs`` (name, ts us, dur us) and ``regions``."""
    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "trio"}},
        {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "cpu:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "cpu:0 compute"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "regions"}},
    ]
    for name, ts, dur in programs:
        ev.append(
            {"ph": "X", "name": name, "cat": "device", "pid": 2, "tid": 1, "ts": ts, "dur": dur}
        )
    for name, ts, dur in regions:
        ev.append(
            {"ph": "X", "name": name, "cat": "region", "pid": 1, "tid": 9, "ts": ts, "dur": dur}
        )
    return {"traceEvents": ev}


def test_a_program_keeps_its_colour_from_one_plot_to_the_next(tmp_path: Path) -> None:
    # The busiest program came first and took the first colour: one plot's "mlp" was
    # another's "layers_a". Now the colour follows the name, whatever else ran and how long.
    a = hcqa.trace.plot(
        _trace([("mlp", 0, 500), ("layers_a", 600, 100), ("copy", 800, 10)]), tmp_path / "a.png"
    )
    b = hcqa.trace.plot(
        _trace([("layers_a", 0, 900), ("copy", 950, 300), ("mlp", 1300, 5), ("dense", 1400, 50)]),
        tmp_path / "b.png",
    )
    assert a.legend[0] == "mlp" and b.legend[0] == "layers_a"  # the busy order differs...
    for name in ("mlp", "layers_a", "copy"):
        assert a.colors[name] == b.colors[name], name  # ... the colours do not
    assert len(set(b.colors.values())) == len(b.colors)  # distinct within one plot


def test_stable_colors_are_distinct_and_independent_of_order() -> None:
    from hcqa.trace.view import stable_colors

    names = [f"kernel_{i}" for i in range(9)]
    forward, backward = stable_colors(names), stable_colors(names[::-1])
    assert forward == backward and len(set(forward.values())) == 9
    many = stable_colors([f"k{i}" for i in range(30)])
    assert len(set(many.values())) == 18  # both palettes used up, then reused


def _in_a_thread() -> None:
    with region("from a thread"):
        pass


async def test_regions_are_recorded_from_tasks_and_threads(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    with region("no tracer: records nothing"):
        pass
    with Tracer(path) as tracer:
        with hcqa.trace.region("outer", step=1):
            with tracer.region("inner"):
                await trio.sleep(0)
            await trio.to_thread.run_sync(_in_a_thread)
    doc = json.loads(path.read_text())
    regions = [e for e in doc["traceEvents"] if e.get("cat") == "region"]
    assert [e["name"] for e in regions] == ["inner", "from a thread", "outer"]  # in exit order
    assert regions[2]["args"] == {"step": 1}
    (track,) = {(e["pid"], e["tid"]) for e in regions}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert names[track] == "regions"
    outer, inner = regions[2], regions[0]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    for bad, got in (("  ", "'  '"), (3, "3"), (None, "None")):
        with pytest.raises(hcqa.InvalidCommand) as info:
            region(bad)  # type: ignore[arg-type]
        assert str(info.value) == f"a region's 'name' must be a non-empty str (got {got})"
        with pytest.raises(hcqa.InvalidCommand):
            Tracer(tmp_path / "unused.json").region(bad)  # type: ignore[arg-type]


def test_the_demo_marks_which_part_is_which_and_the_plot_labels_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "demo.json"
    argv = ["demo", "--quick", "--no-progress", "--trace", str(trace), "--workdir", str(tmp_path)]
    assert cli.main(argv) == 0
    capsys.readouterr()
    doc = hcqa.trace.load(trace)
    names = [e["name"] for e in doc["traceEvents"] if e.get("cat") == "region"]
    assert names == [
        "warm-up: pipeline",
        "warm-up: 1 device",
        "pipeline 1-4",
        "1 device 1-4",
        "1 device 5-8",
        "pipeline 5-8",
    ]
    summary = hcqa.trace.summarize(doc)
    assert "regions" in summary and "pipeline 1-4" in summary and "cpu:1" in summary

    # the command as a user runs it, on the demo's trace
    png = tmp_path / "demo.png"
    proc = subprocess.run(
        [sys.executable, "-m", "hcqa.cli", "trace", "plot", str(trace), "-o", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"wrote {png}: hcqa trace:")
    assert lines[1].startswith("regions: 'warm-up: pipeline', 'warm-up: 1 device', 'pipeline 1-4',")
    assert "https://ui.perfetto.dev" in lines[-1]
    info = hcqa.trace.plot(doc, tmp_path / "again.png")
    assert info.rows[0] == "regions" and info.regions == tuple(names)

    # zoom on one region: the window is that region
    zoomed = hcqa.trace.plot(doc, tmp_path / "z.png", region="1 device 1-4")
    (r,) = [e for e in doc["traceEvents"] if e.get("name") == "1 device 1-4"]
    t0 = min(e["ts"] for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") != "region")
    assert zoomed.window == pytest.approx(((r["ts"] - t0) / 1000, (r["ts"] + r["dur"] - t0) / 1000))
    assert "pipeline 1-4" not in zoomed.regions  # the pipeline's parts are outside it


def test_a_sparse_trace_says_how_to_zoom(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A server's trace: a few short bursts of work over seconds of waiting.
    bursts = [("dense", 1_000_000.0 * k, 2000.0) for k in range(5)]
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(_trace(bursts)))
    assert cli.main(["trace", "plot", str(path), "-o", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "the device queues were busy 0.2% of the plotted 4002 ms" in out
    assert "--from TIME --to TIME" in out and "https://ui.perfetto.dev" in out
    # zooming on the third burst, with units as on the axis
    argv = ["trace", "plot", str(path), "-o", str(tmp_path / "z.png"), "--from", "1.999s"]
    assert cli.main([*argv, "--to", "2003ms"]) == 0
    out = capsys.readouterr().out
    assert "1 ranges in 1999-2003 ms" in out and "were busy" not in out
    info = hcqa.trace.plot(_trace(bursts), tmp_path / "z2.png", start_ms=1999, end_ms=2003)
    assert info.rows == ("cpu:0 compute  50%",) and info.busy_share == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--from", "4x"],
            "argument --from: must be a time such as 4.2s, 350ms or 120us (got '4x')",
        ),
        (
            ["--from", "5ms", "--to", "1ms"],
            "the window must end after it starts (got 5.0 to 1.0 ms)",
        ),
        (["--region", "nope"], "--region must name a region of the trace ('warm'; got 'nope')"),
    ],
)
def test_bad_zooms_are_one_line(
    argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace([("k", 0.0, 10.0)], (("warm", 0.0, 5.0),))))
    try:
        code = cli.main(["trace", "plot", str(path), "-o", str(tmp_path / "t.png"), *argv])
    except SystemExit as exc:  # argparse refuses a bad value itself
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


def test_summary_points_to_perfetto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace([("k", 0.0, 10.0)])))
    assert cli.main(["trace", "summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        out.rstrip()
        .splitlines()[-1]
        .startswith(f"to zoom, pan and inspect every event: open {path}")
    )


def test_region_labels_are_measured_named_shortened_or_numbered(tmp_path: Path) -> None:
    """A region's name is drawn only where its rendered width fits its bar: a wide region
    shows its name, a narrower one its name without the parenthesised part, a narrow one a
    number that the legend spells out -- never a cut or overlapping name."""
    regions = (
        ("warm-up: pipeline (OpenCL)", 0, 50_000),  # wide: the whole name
        ("pipeline (OpenCL with a long note) 1-16", 50_000, 15_000),  # the short form fits
        ("1 OpenCL device 1-16", 65_000, 6_000),  # narrow: numbered
        ("1 OpenCL device 17-32", 71_000, 6_000),
        ("x", 77_000, 23_000),
    )
    info = hcqa.trace.plot(_trace([("k", 0, 100_000)], regions), tmp_path / "r.png")
    assert info.regions == tuple(r[0] for r in regions)
    assert info.region_labels == (
        "warm-up: pipeline (OpenCL)", "pipeline 1-16", "[1]", "[2]", "x",
    )  # fmt: skip
    assert info.legend[-2:] == (
        "region [1]: 1 OpenCL device 1-16", "region [2]: 1 OpenCL device 17-32",
    )  # fmt: skip
    # too narrow for a number, or past the numbers one legend can list: unlabelled, counted
    tiny = tuple((f"region {i}", i * 10, 10) for i in range(400))
    many = hcqa.trace.plot(_trace([("k", 0, 4000)], tiny), tmp_path / "t.png")
    assert set(many.region_labels) == {""}
    assert many.legend == ("k", "400 regions too narrow to label (zoom: --region, --from/--to)")
    some = tuple((f"region number {i}", i * 5000, 5000) for i in range(20))  # room: a number
    numbered = hcqa.trace.plot(_trace([("k", 0, 100_000)], some), tmp_path / "n.png")
    assert numbered.region_labels == (*(f"[{i + 1}]" for i in range(12)), *[""] * 8)
    assert numbered.legend[1] == "region [1]: region number 0" and len(numbered.legend) == 14


def test_a_step_that_held_the_loop_says_how_long(tmp_path: Path) -> None:
    """A trio step long enough to matter (a blocking build on the loop) is labelled with
    the time it held the loop; short steps are not."""
    doc = _trace([("k", 0, 3_000_000)])
    doc["traceEvents"] += [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 5, "args": {"name": "main"}},
        {"ph": "X", "name": "main", "cat": "trio", "pid": 1, "tid": 5, "ts": 0, "dur": 2_650_000},
        {"ph": "X", "name": "main", "cat": "trio", "pid": 1, "tid": 5, "ts": 2_700_000, "dur": 40},
    ]
    info = hcqa.trace.plot(doc, tmp_path / "s.png")
    assert info.long_steps == ("loop held 2.65 s",)
