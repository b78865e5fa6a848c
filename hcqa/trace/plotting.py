"""Drawing a trace: ``hcqa trace plot`` (re-exported by :mod:`hcqa.trace.view` and hcqa.trace).

Theory of operation
-------------------
:func:`plot` draws one figure: the device queues on top (bars coloured by program, the busy
share in each label), the busiest trio tasks below (their steps in grey), a time axis in ms or
s, a legend of the busiest programs, and the signal waits that cross queues as thin, light
lines *behind* the bars. At most ``max_flows`` of them are drawn, picked evenly over the whole
trace, and the title says how many of how many. It returns a :class:`PlotInfo` saying what it
drew, for tests and for the command's one-line report.

Labels are measured, not guessed: once the layout is known, each region's name is drawn in
its bar only if its rendered width fits there; otherwise a shorter form (without its
parenthesised part), else a number whose name the legend lists under "regions", else
nothing (the legend still lists it). A trio task step long enough to matter (at least
``LONG_STEP_US`` and a visible share of the window) -- the event loop held, by a blocking
call such as a build on the loop -- is labelled in its bar with how long it held the loop.

The document is checked and sorted into tracks by :mod:`hcqa.trace.reading`; matplotlib is
imported only inside the functions that draw or pick colours.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from hcqa.errors import InvalidCommand
from hcqa.trace import _served
from hcqa.trace._served import Chain
from hcqa.trace.reading import Event, Track, _busy, _clip, _ms, _view, check

__all__ = ["PlotInfo", "plot", "stable_colors"]

FlowMode = Literal["sample", "all", "none"]
LONG_STEP_US = 50_000.0  # a trio step this long held the event loop: its bar says so
MAX_NUMBERED = 12  # regions numbered in one plot (each a legend line)


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
    # what each region's bar says (its name, a shorter form, "[k]" listed in the legend, or
    # "" where not even that fits), in the order of ``regions``
    region_labels: tuple[str, ...] = ()
    long_steps: tuple[str, ...] = ()  # the labels of trio steps that held the loop
    # a served model (trace/serving.py): its rows (one per endpoint, one per model's batches)
    # and the batches tied to their requests and kernels by colour and lines
    served: tuple[str, ...] = ()
    chains: tuple[Chain, ...] = ()


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


def _short(name: str) -> str:
    """A region's name without its parenthesised parts: 'pipeline (OpenCL) 1-16' ->
    'pipeline 1-16' (the name itself if it has none)."""
    out, depth = [], 0
    for ch in name:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return " ".join("".join(out).split()) or name


def _label_regions(
    ax: Any, bars: Sequence[tuple[float, float, int, str]], renderer: Any
) -> tuple[list[str], list[tuple[str, str]], list[Any]]:
    """Draw each region's label where it fits (see the module doc). ``bars``: (x start,
    x end, level, name). Returns what each bar says ('' for nothing), the (number, name)
    pairs the legend must list (at most ``MAX_NUMBERED``), and the text artists drawn."""
    said: list[str] = []
    key: list[tuple[str, str]] = []
    artists: list[Any] = []
    for a, b, level, name in bars:
        (x0, _), (x1, _) = ax.transData.transform([(a, level), (b, level)])
        room = x1 - x0 - 10  # px, a little air on each side
        short = _short(name)
        forms = [name] if short == name else [name, short]
        number = f"[{len(key) + 1}]"
        here = ""
        for form in [*forms, number] if len(key) < MAX_NUMBERED else forms:
            t = ax.text((a + b) / 2, level, form, ha="center", va="center", fontsize=7.5, zorder=4)
            if t.get_window_extent(renderer).width <= room:
                here = form
                artists.append(t)
                break
            t.remove()
        if here == number:
            key.append((number, name))
        said.append(here)
    return said, key, artists


def _label_long_steps(
    ax: Any, steps: Sequence[tuple[float, float, float, int]], renderer: Any
) -> list[str]:
    """Label each trio step in ``steps`` (x start, x width, µs, row) with how long it held
    the event loop, where the label fits in its bar."""
    said = []
    for a, w, dur, row in steps:
        text = f"loop held {dur / 1e6:.2f} s" if dur >= 1e6 else f"loop held {dur / 1e3:.0f} ms"
        t = ax.text(a + w / 2, row, text, ha="center", va="center", fontsize=7, zorder=4)
        (x0, _), (x1, _) = ax.transData.transform([(a, row), (a + w, row)])
        if t.get_window_extent(renderer).width <= x1 - x0 - 4:
            said.append(text)
        else:
            t.remove()
    return said


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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if flows not in ("sample", "all", "none"):
        raise InvalidCommand(f"flows must be 'sample', 'all' or 'none' (got {flows!r})")
    v = _view(doc)
    events = check(doc)
    t0 = min((e["ts"] for e in v.ranges), default=0.0)
    t_end = max((e["ts"] + e["dur"] for e in v.ranges), default=t0)
    lo, hi = t0, t_end
    if region is not None:
        named = [r for r in v.regions if r["name"] == region]
        if not named:
            known = ", ".join(repr(n) for n in dict.fromkeys(r["name"] for r in v.regions))
            raise InvalidCommand(
                f"'region' must name a region of the trace ({known or 'it has none'}; "
                f"got {region!r})"
            )
        lo, hi = min(r["ts"] for r in named), max(r["ts"] + r["dur"] for r in named)
    if start_ms is not None:
        lo = t0 + start_ms * 1000
    if end_ms is not None:
        hi = t0 + end_ms * 1000
    if hi <= lo and (start_ms is not None or end_ms is not None):
        raise InvalidCommand(f"the window must end after it starts (got {start_ms} to {end_ms} ms)")
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
    served = _served.collect(v, events, lo, hi, _chain_color)
    n_served = len(served.rows)
    row = {k: i + n_region_rows + n_served for i, k in enumerate(keys)}
    task_label = v.task_labels()
    names = [v.track_name(k) for k in dev_keys] + [task_label[k] for k in task_keys]
    labels = [  # a queue's busy share; a task's time on the loop (its steps are short)
        f"{name}  {100 * busy[k] / span_us:.0f}%"
        if k[0] != v.trio_pid and span_us > 0
        else f"{name}  {_ms(busy[k])}"
        for name, k in zip(names, keys, strict=True)
    ]
    region_labels = ["regions" if i == 0 else f"regions ({i + 1})" for i in range(n_region_rows)]
    all_labels = region_labels + list(served.labels) + labels
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
    renderer = FigureCanvasAgg(fig).get_renderer()  # type: ignore[no-untyped-call]
    ax = fig.add_subplot()
    min_w = span_us * 0.0008 / scale  # a step too short to see still shows as a tick
    long_steps: list[tuple[float, float, float, int]] = []  # (x, width, us, row)
    for k, es in tracks.items():
        if k not in row:
            continue
        spans = [(x(a), max(d / scale, min_w)) for a, d, _ in es]
        if k[0] == v.trio_pid:
            long_steps += [
                (x(a), d / scale, d, row[k])
                for a, d, _ in es
                if d >= LONG_STEP_US and span_us > 0 and d / span_us >= 0.02
            ]
        face: list[Any] = [trio_color if k[0] == v.trio_pid else colors[n] for _, _, n in es]
        ax.broken_barh(spans, (row[k] - 0.38, 0.76), facecolors=face, linewidth=0, zorder=2)
    if dev_keys and task_keys:
        ax.axhline(n_region_rows + n_served + len(dev_keys) - 0.5, color="0.3", lw=0.8, zorder=3)
    chain_handles = _served.draw(ax, served, x, scale, n_region_rows, row)
    if n_served and keys:
        ax.axhline(n_region_rows + n_served - 0.5, color="0.3", lw=0.8, zorder=3)

    # Regions: a bar per region in the rows on top (labelled once the layout is known); the
    # outermost ones also shade the rows below, every other one, with a line where each
    # starts and ends.
    region_bars: list[tuple[float, float, int, str]] = []
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
        region_bars.append((x(a), x(b), level, r["name"]))
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
    handles += chain_handles

    def lay_out(key: Sequence[tuple[str, str]], unlabelled: int = 0) -> None:
        listed = [Patch(color="none", label=f"region {n}: {name}") for n, name in key]
        if unlabelled:
            note = f"{unlabelled} region{'s' if unlabelled > 1 else ''} too narrow to label"
            listed.append(Patch(color="none", label=f"{note} (zoom: --region, --from/--to)"))
        if handles or listed:
            ax.legend(
                handles=[*handles, *listed],
                fontsize=8,
                loc="upper left",
                bbox_to_anchor=(1.005, 1.0),
                frameon=False,
                title="legend",
                title_fontsize=8,
            )
        fig.tight_layout()

    # Labels are placed by their measured widths, so the layout comes first; a region
    # numbered instead of named adds a legend line, which narrows the axes: lay out again
    # (the numbering settles within a pass or two).
    key: list[tuple[str, str]] = []
    unlabelled = 0
    for _ in range(3):
        lay_out(key, unlabelled)
        said, new_key, drawn = _label_regions(ax, region_bars, renderer)
        new_unlabelled = said.count("")
        if (new_key, new_unlabelled) == (key, unlabelled):
            break
        for t in drawn:
            t.remove()
        key, unlabelled = new_key, new_unlabelled
    else:
        said, key, _ = _label_regions(ax, region_bars, renderer)
        unlabelled = said.count("")
        lay_out(key, unlabelled)
    held = _label_long_steps(ax, long_steps, renderer)
    legend = ax.get_legend()
    fig.savefig(os.fspath(out), dpi=110, format="png")
    return PlotInfo(
        rows=tuple(all_labels),
        tasks_shown=len(task_keys),
        tasks_total=len(all_tasks),
        flows_drawn=len(chosen),
        flows_total=len(pairs),
        legend=tuple(t.get_text() for t in legend.get_texts()) if legend is not None else (),
        title=title,
        colors={n: colors[n] for n in by_program},
        regions=tuple(r["name"] for r in regions),
        window=((lo - t0) / 1000, (hi - t0) / 1000),
        busy_share=busy_share,
        region_labels=tuple(said),
        long_steps=tuple(held),
        served=served.labels,
        chains=tuple(c for c, _, _, _ in served.chains),
    )


def _chain_color(i: int) -> tuple[float, float, float, float]:
    """A chain's colour: matplotlib's Dark2 (a program's colours are tab10's)."""
    from matplotlib import colormaps

    dark = colormaps["Dark2"]
    return tuple(dark(i % 8))  # type: ignore[return-value]
