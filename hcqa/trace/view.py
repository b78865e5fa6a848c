"""Reading traces back: ``hcqa trace summary`` and ``hcqa trace plot`` (re-exported by hcqa.trace).

Theory of operation
-------------------
:func:`load` reads a Chrome Trace Event JSON file and checks every event that the readers use,
so a damaged or foreign file gives one sentence naming the file, the event and what is wrong
(:class:`TraceFormatError`); tracks are ``(pid, tid)`` pairs, a track per trio task and one
per device queue (:mod:`hcqa.trace.reading`: loading, checking and the tracks).

:func:`summarize` gives per-queue busy time, per-program counts and times, copy bandwidth and
the busiest trio tasks, as plain-text tables (``_tables.py``); a table with no rows is
left out, and a trace with no device work says so in one line.

:func:`plot` draws the trace as one timeline PNG and returns a :class:`PlotInfo` saying what it
drew (:mod:`hcqa.trace.plotting`).

This module is where the readers are imported from: it re-exports :func:`load`,
:func:`check`, :class:`TraceFormatError` and ``REGION`` from :mod:`hcqa.trace.reading`, and
:func:`plot`, :class:`PlotInfo` and :func:`stable_colors` from :mod:`hcqa.trace.plotting`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hcqa.trace.plotting import PlotInfo, plot, stable_colors
from hcqa.trace.reading import REGION, TraceFormatError, Track, _busy, _clip, _view, check, load

__all__ = [
    "REGION",
    "PlotInfo",
    "TraceFormatError",
    "check",
    "load",
    "plot",
    "stable_colors",
    "summarize",
]


# -- summary ----------------------------------------------------------------------------------


def summarize(doc: Mapping[str, Any], *, max_tasks: int = 8) -> str:
    """Per-queue busy time, per-program times, copy bandwidth, the busiest trio tasks; text."""
    from hcqa.trace._tables import render, table

    v = _view(doc)
    if not v.ranges:
        return "no ranges in this trace: nothing was recorded (was the tracer installed?)"
    start = min(e["ts"] for e in v.ranges)
    span = max(e["ts"] + e["dur"] for e in v.ranges) - start
    dropped = doc.get("otherData", {}).get("dropped_events", 0)
    head = f"span {span / 1000:.3f} ms, {len(v.ranges)} ranges, {dropped} events dropped"
    parts: list[Any] = [head]
    device = v.device
    if not device:
        parts.append(
            "no device work in this trace: only trio task steps were recorded (work done in "
            "worker processes or outside hcqa devices is not traced)"
        )
    tracks: dict[Any, list[tuple[float, float]]] = {}
    for e in device:  # per queue, and per device (the key is just the pid)
        for k in ((e["pid"], e["tid"]), e["pid"]):
            tracks.setdefault(k, []).append((e["ts"], e["dur"]))
    rows = []
    for k in sorted(tracks, key=lambda k: (k, 0) if isinstance(k, int) else k):
        pid, queue = (k, "(all)") if isinstance(k, int) else (k[0], v.track_name(k))
        busy = _busy(tracks[k])
        pct = 100 * busy / span if span > 0 else 0.0
        queue = queue.rpartition(" ")[2]
        rows.append([v.device_name(pid), queue, f"{busy / 1000:.3f}", f"{pct:.1f}"])
    programs: dict[tuple[str, str], list[float]] = {}
    moves: dict[tuple[str, str], list[float]] = {}
    for e in device:
        args, dev = e.get("args") or {}, v.device_name(e["pid"])
        if "bytes" in args:
            what = f"transfer {args['src']}->{args['dest']}" if "src" in args else None
            kind = str(what or args.get("kind", e.get("name", "?")))
            acc = moves.setdefault((kind, dev), [0, 0.0, 0])
            acc[2] += args["bytes"]
        else:
            acc = programs.setdefault((e.get("name", "?"), dev), [0, 0.0])
        acc[0] += 1
        acc[1] += e["dur"]
    program_rows = [
        [name, dev, int(n), f"{tot / 1000:.3f}", f"{tot / n:.2f}"]
        for (name, dev), (n, tot) in sorted(programs.items(), key=lambda kv: -kv[1][1])
    ]
    copy_rows = [
        [name, dev, int(n), int(nb), f"{tot / 1000:.3f}", f"{nb / tot / 1e3:.3f}"]
        for (name, dev), (n, tot, nb) in sorted(moves.items())
        if tot > 0
    ]
    steps: dict[Track, list[float]] = {}
    for e in v.ranges:
        if e["pid"] == v.trio_pid:
            acc = steps.setdefault((e["pid"], e["tid"]), [0, 0.0])
            acc[0] += 1
            acc[1] += e["dur"]
    busiest = sorted(steps.items(), key=lambda kv: -kv[1][1])
    label = v.task_labels()
    task_rows = [[label[k], int(n), f"{tot / 1000:.3f}"] for k, (n, tot) in busiest][:max_tasks]
    shown = f"(the {len(task_rows)} busiest of {len(busiest)})" if len(busiest) > max_tasks else ""
    region_rows = []
    for r in v.regions:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        shares = []
        for pid in sorted({e["pid"] for e in device}):
            inside = _clip([(e["ts"], e["dur"]) for e in device if e["pid"] == pid], lo, hi)
            if inside and r["dur"] > 0:
                shares.append(f"{v.device_name(pid)} {100 * _busy(inside) / r['dur']:.0f}%")
        region_rows.append(
            [r["name"], f"{(lo - start) / 1000:.3f}", f"{r['dur'] / 1000:.3f}", ", ".join(shares)]
        )
    for title, headers, body, text in (
        ("regions", ["region", "start ms", "length ms", "devices busy"], region_rows, 1),
        ("device queues", ["device", "queue", "busy ms", "busy %"], rows, 2),
        ("programs", ["program", "device", "count", "total ms", "mean us"], program_rows, 2),
        ("copies", ["copy", "device", "count", "bytes", "total ms", "GB/s"], copy_rows, 2),
        (f"trio tasks {shown}".strip(), ["task", "steps", "total ms"], task_rows, 1),
    ):
        if body:
            parts.append(table(headers, body, title=title, text_columns=text))
    return render(*parts)
