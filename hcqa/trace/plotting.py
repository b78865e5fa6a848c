"""Drawing a trace: ``hcqa trace plot`` (re-exported by :mod:`hcqa.trace.view` and hcqa.trace).

Theory of operation
-------------------
:func:`plot` draws one figure: the device queues on top (bars coloured by program, the busy
share in each label), the busiest trio tasks below (their steps in grey), a time axis in ms or
s, a legend of the busiest programs, and the signal waits that cross queues as thin, light
lines *behind* the bars. At most ``max_flows`` of them are drawn, picked evenly over the whole
trace, and the title says how many of how many. It returns a :class:`PlotInfo` saying what it
drew, for tests and for the command's one-line report.

The document is checked and sorted into tracks by :mod:`hcqa.trace.reading`; matplotlib is
imported only inside the functions that draw or pick colours.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from hcqa.trace.reading import Event, Track, _busy, _clip, _ms, _view, check

__all__ = ["PlotInfo", "plot", "stable_colors"]

FlowMode = Literal["sample", "all", "none"]


@attrs.frozen(kw_only=True)
class PlotInfo:
    """What :func:`plot` drew: its row labels (top to bottom), the flows, the legend, the
    regions, the window (ms since the trace's first range) and how much of it had work."""

    rows: tuple[str, ...]
    tasks_shown: int
    tasks_total: int
    flows_drawn: int
    flows_total: int
    legend: tuple[str, ...]
    title: str
    colors: dict[str, tuple[float, float, float, float]] = attrs.field(factory=dict)
    regions: tuple[str, ...] = ()
    window: tuple[float, float] = (0.0, 0.0)
    busy_share: float = 0.0  # of the window, the share in which some device queue was busy


def _flow_pairs(events: Sequence[Event], rows: Mapping[Track, int]) -> list[tuple[Event, Event]]:
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    pairs = []
    for f in events:
        if f["ph"] != "f":
            continue
        s = starts.get(f["id"])
        if s is not None and (s["pid"], s["tid"]) in rows and (f["pid"], f["tid"]) in rows:
            pairs.append((s, f))
    return pairs


def _pick(n: int, cap: int) -> list[int]:
    """``min(n, cap)`` indices spread evenly over ``range(n)``."""
    if n <= cap:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(cap - 1, 1)) for i in range(cap)})


def _palettes() -> list[list[tuple[float, float, float, float]]]:
    """Fixed palettes: matplotlib's tab10 without its grey (grey is a trio step), then the
    light shades of the same hues (tab20's), for a plot with more than nine names."""
    from matplotlib import colormaps

    tab10, tab20 = colormaps["tab10"], colormaps["tab20"]
    return [
        [tab10(i) for i in range(10) if i != 7],
        [tab20(2 * i + 1) for i in range(10) if i != 7],
    ]


def stable_colors(names: Sequence[str]) -> dict[str, tuple[float, float, float, float]]:
    """A colour per name, from a fixed palette by a hash of the name (CRC-32), so a program
    keeps its colour from one plot to the next whatever else ran. A name whose colour is
    already taken in this plot moves to the next free one (names in sorted order); past nine
    names the light shades are used the same way."""
    palettes = _palettes()
    taken: set[tuple[int, int]] = set()
    out = {}
    for name in sorted(set(names)):
        h = zlib.crc32(name.encode())
        free = [
            (p, (h + step) % len(palette))
            for p, palette in enumerate(palettes)
            for step in range(len(palette))
            if (p, (h + step) % len(palette)) not in taken
        ]
        p, i = free[0] if free else (0, h % len(palettes[0]))
        taken.add((p, i))
        out[name] = palettes[p][i]
    return out


def _levels(regions: Sequence[Event]) -> list[int]:
    """Each region's nesting level (0: inside no other), regions sorted by start."""
    levels: list[int] = []
    open_ends: list[float] = []  # the ends of the regions enclosing the current one
    for r in regions:
        while open_ends and open_ends[-1] <= r["ts"]:
            open_ends.pop()
        levels.append(len(open_ends))
        open_ends.append(r["ts"] + r["dur"])
    return levels


def _fit(label: str, width_px: float, char_px: float = 6.5) -> str:
    """``label`` shortened with an ellipsis to fit ``width_px``; '' if not even 3 chars fit."""
    room = int((width_px - 6) / char_px)
    if room >= len(label):
        return label
    return label[: room - 1] + "…" if room >= 3 else ""


def plot(
    doc: Mapping[str, Any],
    out: str | os.PathLike[str],
    *,
    max_tasks: int = 8,
    flows: FlowMode = "sample",
    max_flows: int = 200,
    start_ms: float | None = None,
    end_ms: float | None = None,
    region: str | None = None,
) -> PlotInfo:
    """Draw a timeline PNG: the trace's regions, device queues, then the busiest trio tasks
    (needs matplotlib).

    ``flows``: ``"sample"`` draws at most ``max_flows`` cross-queue waits, spread over the
    trace; ``"all"`` draws every one; ``"none"`` draws none. The title says which.
    ``start_ms`` / ``end_ms`` (ms since the trace's first range) or ``region`` (a region's
    name: from the first such region's start to the last one's end) zoom in on a window;
    ranges are cut at its edges and busy shares are of the window."""
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if flows not in ("sample", "all", "none"):
        raise ValueError(f"flows must be 'sample', 'all' or 'none' (got {flows!r})")
    v = _view(doc)
    events = check(doc)
    t0 = min((e["ts"] for e in v.ranges), default=0.0)
    t_end = max((e["ts"] + e["dur"] for e in v.ranges), default=t0)
    lo, hi = t0, t_end
    if region is not None:
        named = [r for r in v.regions if r["name"] == region]
        if not named:
            known = ", ".join(repr(n) for n in dict.fromkeys(r["name"] for r in v.regions))
            raise ValueError(
                f"'region' must name a region of the trace ({known or 'it has none'}; "
                f"got {region!r})"
            )
        lo, hi = min(r["ts"] for r in named), max(r["ts"] + r["dur"] for r in named)
    if start_ms is not None:
        lo = t0 + start_ms * 1000
    if end_ms is not None:
        hi = t0 + end_ms * 1000
    if hi <= lo and (start_ms is not None or end_ms is not None):
        raise ValueError(f"the window must end after it starts (got {start_ms} to {end_ms} ms)")
    span_us = hi - lo
    unit, scale = ("s", 1e6) if span_us >= 1e6 else ("ms", 1e3)

    def x(ts: float) -> float:  # the x axis: time since the trace's first range
        return (ts - t0) / scale

    tracks: dict[Track, list[tuple[float, float, str]]] = {}
    for e in v.ranges:
        for a, d in _clip([(e["ts"], e["dur"])], lo, hi):
            tracks.setdefault((e["pid"], e["tid"]), []).append((a, d, e.get("name", "?")))
    busy = {k: _busy([(a, d) for a, d, _ in es]) for k, es in tracks.items()}
    dev_keys = sorted(k for k in tracks if k[0] != v.trio_pid)
    all_tasks = sorted((k for k in tracks if k[0] == v.trio_pid), key=lambda k: -busy[k])
    task_keys = all_tasks[:max_tasks]
    regions = [r for r in v.regions if r["ts"] < hi and r["ts"] + r["dur"] > lo]
    levels = _levels(regions)
    n_region_rows = max(levels, default=-1) + 1
    keys = dev_keys + task_keys
    row = {k: i + n_region_rows for i, k in enumerate(keys)}
    task_label = v.task_labels()
    names = [v.track_name(k) for k in dev_keys] + [task_label[k] for k in task_keys]
    labels = [  # a queue's busy share; a task's time on the loop (its steps are short)
        f"{name}  {100 * busy[k] / span_us:.0f}%"
        if k[0] != v.trio_pid and span_us > 0
        else f"{name}  {_ms(busy[k])}"
        for name, k in zip(names, keys, strict=True)
    ]
    region_labels = ["regions" if i == 0 else f"regions ({i + 1})" for i in range(n_region_rows)]
    all_labels = region_labels + labels
    device_spans = [(a, d) for k in dev_keys for a, d, _ in tracks[k]]
    busy_share = _busy(device_spans) / span_us if span_us > 0 else 0.0

    by_program: dict[str, float] = {}
    for k in dev_keys:
        for _, d, name in tracks[k]:
            by_program[name] = by_program.get(name, 0.0) + d
    colors = stable_colors([e.get("name", "?") for e in v.device])
    trio_color = "0.55"

    n_rows = len(all_labels)
    fig = Figure(figsize=(13, 2.0 + 0.38 * max(1, n_rows)))
    ax = fig.add_subplot()
    min_w = span_us * 0.0008 / scale  # a step too short to see still shows as a tick
    for k, es in tracks.items():
        if k not in row:
            continue
        spans = [(x(a), max(d / scale, min_w)) for a, d, _ in es]
        face: list[Any] = [trio_color if k[0] == v.trio_pid else colors[n] for _, _, n in es]
        ax.broken_barh(spans, (row[k] - 0.38, 0.76), facecolors=face, linewidth=0, zorder=2)
    if dev_keys and task_keys:
        ax.axhline(n_region_rows + len(dev_keys) - 0.5, color="0.3", lw=0.8, zorder=3)

    # Regions: a labelled bar per region in the rows on top; the outermost ones also shade
    # the rows below, every other one, with a line where each starts and ends.
    ax_px = 13 * 110 * 0.72  # the axes' width in pixels, near enough to fit labels
    for i, (r, level) in enumerate(zip(regions, levels, strict=True)):
        a, b = max(r["ts"], lo), min(r["ts"] + r["dur"], hi)
        ax.broken_barh(
            [(x(a), (b - a) / scale)],
            (level - 0.4, 0.8),
            facecolors=["0.80" if i % 2 else "0.90"],
            edgecolors=["0.35"],
            linewidth=0.6,
            zorder=2,
        )
        text = _fit(r["name"], (b - a) / span_us * ax_px if span_us > 0 else 0.0)
        if text:
            ax.text(x((a + b) / 2), level, text, ha="center", va="center", fontsize=7.5, zorder=4)
        if level == 0:
            if i % 2 == 0:
                ax.axvspan(x(a), x(b), color="0.5", alpha=0.06, lw=0, zorder=0)
            for edge in (a, b):
                ax.axvline(x(edge), color="0.45", lw=0.6, ls=":", zorder=1)
    if n_region_rows and keys:
        ax.axhline(n_region_rows - 0.5, color="0.3", lw=0.8, zorder=3)

    pairs = [
        (s, f) for s, f in _flow_pairs(events, row) if lo <= s["ts"] <= hi and lo <= f["ts"] <= hi
    ]
    chosen = (
        []
        if flows == "none"
        else pairs
        if flows == "all"
        else [pairs[i] for i in _pick(len(pairs), max_flows)]
    )
    if chosen:
        segs = [
            [(x(s["ts"]), row[s["pid"], s["tid"]]), (x(f["ts"]), row[f["pid"], f["tid"]])]
            for s, f in chosen
        ]
        ax.add_collection(LineCollection(segs, colors="0.1", linewidths=0.5, alpha=0.4, zorder=1))
    if not pairs:
        flow_note = "no cross-queue waits"
    elif len(chosen) == len(pairs):
        flow_note = f"all {len(pairs)} cross-queue waits drawn"
    elif flows == "none":
        flow_note = f"{len(pairs)} cross-queue waits, none drawn"
    else:
        flow_note = f"{len(chosen)} of {len(pairs)} cross-queue waits drawn, evenly sampled"

    ax.set_yticks(range(n_rows), all_labels, fontsize=8)
    ax.set_ylim(max(n_rows, 1) - 0.5, -0.5)
    if not keys:
        ax.text(0.5, 0.5, "no ranges in this trace", transform=ax.transAxes, ha="center")
    ax.set_xlim(x(lo), x(lo) + max(span_us / scale, 1e-9) * 1.01)
    ax.set_xlabel(f"time since the trace's first range ({unit})")
    ax.grid(axis="x", color="0.9", zorder=0)
    ax.set_axisbelow(True)
    hidden = len(all_tasks) - len(task_keys)
    task_note = (
        f"; {hidden} quieter trio task{'s' if hidden > 1 else ''} not shown" if hidden > 0 else ""
    )
    zoomed = (lo, hi) != (t0, t_end)
    window = (
        f" in {x(lo):.4g}-{x(hi):.4g} {unit}" if zoomed else f" over {span_us / scale:.4g} {unit}"
    )
    n_ranges = sum(len(es) for es in tracks.values())
    title = (
        f"hcqa trace: {len(dev_keys)} device queues, {len(task_keys)} trio tasks, "
        f"{n_ranges} ranges{window}\n{flow_note}{task_note}"
    )
    ax.set_title(title, fontsize=10)
    top = sorted(by_program, key=lambda n: -by_program[n])[:10]
    handles: list[Any] = [Patch(color=colors[n], label=n) for n in top]
    if task_keys:
        handles.append(Patch(color=trio_color, label="trio task step"))
    if chosen:
        handles.append(Line2D([], [], color="0.1", lw=0.8, alpha=0.6, label="cross-queue wait"))
    if handles:
        ax.legend(
            handles=handles,
            fontsize=8,
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            frameon=False,
            title="legend",
            title_fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(os.fspath(out), dpi=110, format="png")
    return PlotInfo(
        rows=tuple(all_labels),
        tasks_shown=len(task_keys),
        tasks_total=len(all_tasks),
        flows_drawn=len(chosen),
        flows_total=len(pairs),
        legend=tuple(h.get_label() for h in handles),
        title=title,
        colors={n: colors[n] for n in by_program},
        regions=tuple(r["name"] for r in regions),
        window=((lo - t0) / 1000, (hi - t0) / 1000),
        busy_share=busy_share,
    )
