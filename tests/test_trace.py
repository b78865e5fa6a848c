"""Tracer: Chrome-trace structure and content on real runs, the trace CLI, HCQA_TRACE."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio

import hcqa
from hcqa import cli
from hcqa.actors import engine as engine_mod
from hcqa.trace import TRIO_PID, Tracer, instruments_from_env

ADD1 = """
void add1(float *out, const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + 1.0f;
}
"""
N = 64
EAGER_ADD1 = 5
REPLAYS = 2


def slow_double(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
    time.sleep(0.01)  # long enough that the consumers on other queues really wait
    out[:] = a * 2


async def _read(buf: hcqa.Buffer) -> npt.NDArray[Any]:
    out = np.empty(N, dtype=np.float32)
    await buf.copyout(out)
    return out


async def workload() -> dict[str, npt.NDArray[Any]]:
    """Eager programs, copies, a cross-device transfer, a graph replayed with cross waits."""
    results = {}
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=10) as (d0, d1):
        add1, add1_d1 = d0.program("add1", ADD1), d1.program("add1", ADD1)
        double = d0.program("double", slow_double)
        a, b = (d0.alloc(shape=(N,), dtype="float32") for _ in range(2))
        c, e = (d1.alloc(shape=(N,), dtype="float32") for _ in range(2))
        await a.copyin(np.arange(N, dtype=np.float32))
        for _ in range(EAGER_ADD1):
            add1(b, a, vals=(N,))
        double(b, a)
        await hcqa.transfer(c, b)  # waits on cpu:0 compute: a flow cpu:0 compute -> cpu:1 copy
        results["eager"] = await _read(c)
        with hcqa.capture() as g:
            double(b, a)
            add1(a, b, vals=(N,))  # three static C kernels: one native run
            add1(b, a, vals=(N,))
            add1(a, b, vals=(N,))
            hcqa.transfer(c, a)
            add1_d1(e, c, vals=(N,))
        for _ in range(REPLAYS):
            await g()
        results["graph"] = await _read(e)
        results["a"] = await _read(a)
    return results


# -- the structure validator ----------------------------------------------------------------


def validate(doc: dict[str, Any]) -> None:
    """Check a trace's schema, metadata, per-track nesting and flow pairing."""
    assert isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit") in ("ms", "ns")
    procs: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
    flows: dict[str, dict[int, dict[str, Any]]] = {"s": {}, "f": {}}
    for e in doc["traceEvents"]:
        ph = e["ph"]
        assert ph in {"M", "X", "i", "s", "f"}, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["name"], str) and e["name"], e
        if ph == "M":
            assert e["name"] in {"process_name", "thread_name"}, e
            name = e["args"]["name"]
            assert isinstance(name, str) and name, e
            if e["name"] == "process_name":
                procs[e["pid"]] = name
            else:
                threads[e["pid"], e["tid"]] = name
            continue
        assert isinstance(e["cat"], str) and e["cat"], e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if ph == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["dur"]))
        elif ph in flows:
            assert e["id"] not in flows[ph], f"duplicate flow {ph} id {e['id']}"
            flows[ph][e["id"]] = e
    eps = 1e-6
    for key, ranges in tracks.items():
        assert key[0] in procs and key in threads, f"track {key} has no name"
        stack: list[float] = []  # ends of the open enclosing ranges
        for ts, dur in sorted(ranges, key=lambda r: (r[0], -r[1])):
            while stack and stack[-1] <= ts + eps:
                stack.pop()
            assert not stack or ts + dur <= stack[-1] + eps, f"overlap on {threads[key]} at {ts}"
            stack.append(ts + dur)

    def enclosed(ev: dict[str, Any]) -> bool:
        rs = tracks.get((ev["pid"], ev["tid"]), [])
        return any(ts - eps <= ev["ts"] <= ts + dur + eps for ts, dur in rs)

    assert flows["s"].keys() == flows["f"].keys(), "unpaired flow events"
    for fid, s in flows["s"].items():
        f = flows["f"][fid]
        assert f["ts"] > s["ts"] and (f["name"], f["cat"]) == (s["name"], s["cat"])
        assert enclosed(s) and enclosed(f), f"flow {fid} is not inside a range"


def _tracks(doc: dict[str, Any]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    evs = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in evs if e.get("name") == "thread_name"
    }
    return procs, threads


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Any]:
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    results = trio.run(workload, instruments=[Tracer(path)])
    return path, json.loads(path.read_text()), results


# -- tests ----------------------------------------------------------------------------------


def test_trace_structure(traced: tuple[Path, dict[str, Any], Any]) -> None:
    _, doc, _ = traced
    validate(doc)
    assert engine_mod.trace_hook is None  # off after the run: engines pay one read per run


def test_trace_content(traced: tuple[Path, dict[str, Any], Any]) -> None:
    _, doc, _ = traced
    procs, threads = _tracks(doc)
    assert set(procs.values()) == {"trio", "cpu:0", "cpu:1"}
    assert procs[TRIO_PID] == "trio" and procs[TRIO_PID + 1] == "cpu:0"
    names = set(threads.values())
    assert {"cpu:0 compute", "cpu:0 copy", "cpu:1 compute", "cpu:1 copy"} <= names
    assert {"cpu:0 compute actor", "cpu:1 copy actor"} <= names  # trio tasks, named
    dev = [e for e in doc["traceEvents"] if e.get("cat") == "device" and e["ph"] == "X"]
    where = Counter((e["name"], threads[e["pid"], e["tid"]]) for e in dev)
    assert where["add1", "cpu:0 compute"] == EAGER_ADD1
    assert where["add1", "cpu:1 compute"] == REPLAYS
    assert where["double", "cpu:0 compute"] == 1 + REPLAYS
    assert where["native[add1 x3]", "cpu:0 compute"] == REPLAYS
    assert where["transfer", "cpu:1 copy"] == 1 + REPLAYS
    native = next(e for e in dev if e["name"].startswith("native"))
    assert native["args"] == {"kernels": 3, "names": {"add1": 3}}
    for e in dev:
        if e["name"] == "transfer":
            assert e["args"] == {"bytes": N * 4, "src": "cpu:0", "dest": "cpu:1"}
    copies = Counter(e["args"]["kind"] for e in dev if e["name"] == "copy")
    assert copies == {"copyin": 1, "copyout": 3}
    assert all(e["args"]["bytes"] == N * 4 for e in dev if e["name"] == "copy")
    trio_steps = [e for e in doc["traceEvents"] if e.get("cat") == "trio" and e["ph"] == "X"]
    assert trio_steps and all(e["pid"] == TRIO_PID for e in trio_steps)
    # flows: each transfer waited for cpu:0 compute; each replay's add1 on cpu:1 for the copy
    starts = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "s"}
    pairs = Counter(
        (threads[starts[f["id"]]["pid"], starts[f["id"]]["tid"]], threads[f["pid"], f["tid"]])
        for f in doc["traceEvents"]
        if f["ph"] == "f"
    )
    assert pairs == {
        ("cpu:0 compute", "cpu:1 copy"): 1 + REPLAYS,
        ("cpu:1 copy", "cpu:1 compute"): REPLAYS,
    }


def test_tracing_does_not_change_results(traced: tuple[Path, dict[str, Any], Any]) -> None:
    _, _, with_trace = traced
    plain = trio.run(workload)
    assert plain.keys() == with_trace.keys()
    for key in plain:
        np.testing.assert_array_equal(plain[key], with_trace[key])


async def test_add_instrument_inside_a_run(tmp_path: Path) -> None:
    """Inside a running trio (pytest-trio): add_instrument ... remove_instrument, then save()."""
    tracer = Tracer(tmp_path / "t.json")
    trio.lowlevel.add_instrument(tracer)
    try:
        async with hcqa.open_device("cpu:3", hang_limit=10) as d:
            p = d.program("inc", lambda out: out.__iadd__(1))
            buf = d.alloc(shape=(N,), dtype="float32")
            for _ in range(4):
                p(buf)
            await d.synchronize()
    finally:
        trio.lowlevel.remove_instrument(tracer)
    tracer.save()
    assert engine_mod.trace_hook is None
    doc = json.loads((tmp_path / "t.json").read_text())
    validate(doc)
    procs, threads = _tracks(doc)
    assert "cpu:3" in procs.values() and "cpu:3 compute" in threads.values()
    assert sum(1 for e in doc["traceEvents"] if e["name"] == "inc") == 4
    with Tracer(tmp_path / "ctx.json"):  # the context-manager form does the same
        async with hcqa.open_device("cpu:3") as d:
            await d.alloc(shape=(N,), dtype="float32").copyin(np.zeros(N, np.float32))
    validate(json.loads((tmp_path / "ctx.json").read_text()))


async def test_a_failing_kernel_is_a_range_with_its_error(tmp_path: Path) -> None:
    def boom(out: npt.NDArray[Any]) -> None:
        raise ValueError("boom")

    with Tracer(tmp_path / "t.json"):
        with pytest.raises(hcqa.DeviceFault):
            async with hcqa.open_device("cpu:0", hang_limit=10) as d:
                await d.program("boom", boom)(d.alloc(16))
    doc = json.loads((tmp_path / "t.json").read_text())
    validate(doc)
    (ev,) = [e for e in doc["traceEvents"] if e["name"] == "boom"]
    assert ev["args"] == {"error": "ValueError"}


def test_event_cap_keeps_memory_bounded(tmp_path: Path) -> None:
    tracer = Tracer(tmp_path / "t.json", max_events=40)
    trio.run(workload, instruments=[tracer])
    doc = json.loads((tmp_path / "t.json").read_text())
    validate(doc)
    assert sum(1 for e in doc["traceEvents"] if e["ph"] != "M") <= 40
    assert doc["otherData"]["dropped_events"] > 0


def test_cli_summary(traced: tuple[Path, dict[str, Any], Any], capsys: Any) -> None:
    path, _, _ = traced
    assert cli.main(["trace", "summary", str(path)]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:3]) for line in out.splitlines() if line.strip()}
    assert ("add1", "cpu:0", str(EAGER_ADD1)) in rows
    assert ("add1", "cpu:1", str(REPLAYS)) in rows
    assert ("native[add1", "x3]", "cpu:0") in rows
    assert ("double", "cpu:0", str(1 + REPLAYS)) in rows
    lines = out.splitlines()
    assert any(line.split()[:4] == ["transfer", "cpu:0->cpu:1", "cpu:1", "3"] for line in lines)
    assert any(line.split()[:2] == ["cpu:0", "compute"] for line in lines)
    assert any(line.split()[:2] == ["cpu:1", "(all)"] for line in lines)


def test_cli_summary_of_a_bad_file(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli.main(["trace", "summary", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not a Chrome trace" in err and len(err.strip().splitlines()) == 1


def test_cli_plot(traced: tuple[Path, dict[str, Any], Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path, _, _ = traced
    png = tmp_path / "timeline.png"
    assert cli.main(["trace", "plot", str(path), "-o", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_plot_without_matplotlib(
    traced: tuple[Path, dict[str, Any], Any], tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    path, _, _ = traced
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["trace", "plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert "pip install 'hcqa[plot]'" in capsys.readouterr().err


def test_hcqa_trace_env(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    assert instruments_from_env({}) == [] and instruments_from_env({"HCQA_TRACE": " "}) == []
    path = tmp_path / "env.json"
    monkeypatch.setenv("HCQA_TRACE", str(path))

    async def small() -> None:
        async with hcqa.open_device("cpu:0") as d:
            await d.alloc(shape=(N,), dtype="float32").copyin(np.ones(N, np.float32))

    cli.run_trio(small)  # what CLI commands use instead of trio.run
    assert f"trace written to {path}" in capsys.readouterr().err
    doc = json.loads(path.read_text())
    validate(doc)
    assert any(e["name"] == "copy" for e in doc["traceEvents"])
