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
    assert "pip install -e '.[plot]'" in capsys.readouterr().err


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


# -- reading damaged or foreign traces ---------------------------------------------------------

MALFORMED = {
    "no dur": ({"traceEvents": [{"ph": "X", "name": "k", "pid": 2, "tid": 1, "ts": 0}]}, "'dur'"),
    "text ts": (
        {"traceEvents": [{"ph": "X", "name": "k", "pid": 2, "tid": 1, "ts": "0", "dur": 1}]},
        "non-numeric 'ts'",
    ),
    "NaN dur": (
        {"traceEvents": [{"ph": "X", "name": "k", "pid": 2, "tid": 1, "ts": 0, "dur": "NaN"}]},
        "non-numeric 'dur'",
    ),
    "negative dur": (
        {"traceEvents": [{"ph": "X", "name": "k", "pid": 2, "tid": 1, "ts": 0, "dur": -1}]},
        "negative 'dur'",
    ),
    "flow without id": (
        {"traceEvents": [{"ph": "s", "name": "w", "pid": 2, "tid": 1, "ts": 0}]},
        "'id'",
    ),
    "event not an object": ({"traceEvents": [3]}, "event 0 is a int"),
    "nameless name event": (
        {"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {}}]},
        "args.name",
    ),
    "a list": ([1, 2], "not a Chrome trace"),
    "no traceEvents": ({"events": []}, "not a Chrome trace"),
}


@pytest.mark.parametrize("action", ["summary", "plot"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_trace_is_one_sentence_naming_the_file(
    case: str, action: str, tmp_path: Path, capsys: Any
) -> None:
    doc, what = MALFORMED[case]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc).replace('"NaN"', "NaN"))
    assert (
        cli.main(
            ["trace", action, str(bad), *(["-o", str(tmp_path / "x.png")] * (action == "plot"))]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert str(bad) in err and what in err, err
    assert "KeyError" not in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("content", "what"),
    [(b"", "not JSON"), (b"{'a': 1}", "not JSON"), (b"\xff\xfe\x00", "not a text file")],
)
def test_a_file_that_is_not_json_is_one_sentence(
    content: bytes, what: str, tmp_path: Path, capsys: Any
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert cli.main(["trace", "summary", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(bad) in err and what in err, err


def test_a_directory_or_missing_file_is_one_sentence(tmp_path: Path, capsys: Any) -> None:
    for path, what in ((tmp_path, "Is a directory"), (tmp_path / "none.json", "No such file")):
        assert cli.main(["trace", "summary", str(path)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(path) in err and what in err, err


def test_summary_checks_a_document_handed_to_it() -> None:
    with pytest.raises(hcqa.trace.TraceFormatError, match=r"event 0 .* has no 'dur'"):
        hcqa.trace.summarize({"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "ts": 0}]})
    assert issubclass(hcqa.trace.TraceFormatError, hcqa.HcqaError)


async def test_a_trace_without_device_work_says_so_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "trio-only.json"
    with Tracer(path):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(trio.sleep, 0)
    text = hcqa.trace.summarize(json.loads(path.read_text()))
    assert sum("no device work" in line for line in text.splitlines()) == 1
    for heading in ("device queues", "programs", "copies"):
        assert heading not in text.splitlines()
    assert "trio tasks" in text  # the part that is there is still shown


# -- the picture --------------------------------------------------------------------------------


def _synthetic(n_flows: int, n_workers: int) -> dict[str, Any]:
    """Two device queues with ``n_flows`` waits between them, and ``n_workers`` trio tasks all
    named like the demo's unnamed workers."""
    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "trio"}},
        {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "cpu:0"}},
        {"ph": "M", "name": "process_name", "pid": 3, "tid": 0, "args": {"name": "cpu:1"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "cpu:0 compute"}},
        {"ph": "M", "name": "thread_name", "pid": 3, "tid": 2, "args": {"name": "cpu:1 compute"}},
    ]
    for w in range(n_workers):
        name = "hcqa.cli.demo.drive.<locals>.worker"
        ev.append(
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 10 + w, "args": {"name": name}}
        )
        ev.append(
            {
                "ph": "X",
                "name": name,
                "cat": "trio",
                "pid": 1,
                "tid": 10 + w,
                "ts": 5.0 * w,
                "dur": 1.0 + w,
            }
        )
    for i in range(n_flows):
        t = 100.0 * i
        ev.append(
            {"ph": "X", "name": "layers_a", "cat": "device", "pid": 2, "tid": 1, "ts": t, "dur": 40}
        )
        ev.append(
            {
                "ph": "X",
                "name": "layers_b",
                "cat": "device",
                "pid": 3,
                "tid": 2,
                "ts": t + 50,
                "dur": 40,
            }
        )
        ev.append(
            {"ph": "s", "name": "wait", "cat": "device", "pid": 2, "tid": 1, "ts": t + 20, "id": i}
        )
        ev.append(
            {
                "ph": "f",
                "name": "wait",
                "cat": "device",
                "pid": 3,
                "tid": 2,
                "ts": t + 70,
                "id": i,
                "bp": "e",
            }
        )
    return {"traceEvents": ev}


def test_plot_rows_are_readable_and_distinct(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    info = hcqa.trace.plot(_synthetic(3, 8), tmp_path / "p.png", max_tasks=5)
    # each queue: 3 ranges of 40 us in a trace from 0 to 290 us
    assert info.rows[:2] == ("cpu:0 compute  41%", "cpu:1 compute  41%")
    tasks = info.rows[2:]
    assert len(tasks) == 5 == info.tasks_shown and info.tasks_total == 8
    assert len(set(tasks)) == len(tasks), tasks  # no two rows read alike
    label = "worker (hcqa.cli.demo.drive) #"
    assert all("<locals>" not in r and r.startswith(label) for r in tasks)
    assert tasks[0].startswith("worker (hcqa.cli.demo.drive) #8")  # the busiest task first
    assert "3 quieter trio tasks not shown" in info.title
    assert info.legend == ("layers_a", "layers_b", "trio task step", "cross-queue wait")


@pytest.mark.parametrize(
    ("flows", "max_flows", "drawn", "said"),
    [
        ("sample", 50, 50, "50 of 500 cross-queue waits drawn"),
        ("sample", 1000, 500, "all 500 cross-queue waits drawn"),
        ("all", 50, 500, "all 500 cross-queue waits drawn"),
        ("none", 50, 0, "500 cross-queue waits, none drawn"),
    ],
)
def test_plot_states_its_flow_cap(
    flows: Any, max_flows: int, drawn: int, said: str, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    info = hcqa.trace.plot(_synthetic(500, 1), out, flows=flows, max_flows=max_flows)
    assert (info.flows_drawn, info.flows_total) == (drawn, 500)
    assert said in info.title
    assert ("cross-queue wait" in info.legend) == (drawn > 0)
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plot_samples_flows_over_the_whole_trace() -> None:
    from hcqa.trace.plotting import _pick

    picked = _pick(632, 200)
    assert len(picked) == 200 and picked[0] == 0 and picked[-1] == 631  # not the first 200
    assert _pick(5, 200) == [0, 1, 2, 3, 4] and _pick(10, 1) == [0]


def test_plot_of_the_real_workload(
    traced: tuple[Path, dict[str, Any], Any], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    _, doc, _ = traced
    info = hcqa.trace.plot(doc, tmp_path / "w.png")
    queues = {r.rsplit("  ", 1)[0] for r in info.rows}
    assert {"cpu:0 compute", "cpu:0 copy", "cpu:1 compute", "cpu:1 copy"} <= queues
    assert {"add1", "double", "transfer"} <= set(info.legend)
    assert info.flows_total == sum(e["ph"] == "f" for e in doc["traceEvents"]) > 0


def test_plot_of_an_empty_trace_says_so(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info = hcqa.trace.plot({"traceEvents": []}, tmp_path / "e.png")
    assert info.rows == () and "0 ranges" in info.title and "no cross-queue waits" in info.title
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"
