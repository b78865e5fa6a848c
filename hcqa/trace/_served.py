"""The plot's rows for a served model: requests and batches, and what ties them to kernels.

Theory of operation
-------------------
A served model's trace (:mod:`hcqa.trace.serving`) holds its requests and batches as ranges
of cat ``"serve"`` on *lanes* (``POST /v2/models/mlp/infer #3``). The plot draws one row per
endpoint and one per model's batches (the lanes of a group folded into its row, bars
half-transparent so overlapping requests darken), labelled with the group's name and count.

The ``"serve"`` flows say which requests went into which batch and which device ranges each
batch started (every range a batch ran also carries its ``args.batch``). :func:`collect`
follows them; a few batches spread over the window become *chains*: the batch, its requests
and its kernels drawn in one colour of their own, joined by lines (request -> batch ->
kernel), and listed in the legend. :class:`Chain` is what the plot reports for each.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from hcqa.trace.reading import SERVE, Event, Track, _View

__all__ = ["Chain", "Served", "collect", "draw"]

MAX_CHAINS = 6


@attrs.frozen(kw_only=True)
class Chain:
    """One batch the plot ties to its requests and kernels: their names and its colour."""

    batch: str  # the batch's range name, e.g. "mlp batch x12"
    number: int  # its args.batch
    requests: int  # request ranges with an arrow into it
    kernels: tuple[str, ...]  # the device ranges its arrows reach, and those tagged with it
    color: tuple[float, float, float, float]


@attrs.frozen(kw_only=True)
class Served:
    rows: tuple[str, ...]  # one per endpoint, then one per model's batches
    labels: tuple[str, ...]  # the rows' y labels (with counts)
    members: dict[Track, int]  # lane -> row index (among ``rows``)
    ranges: list[Event]
    chains: list[tuple[Chain, Event, list[Event], list[Event]]]  # chain, batch, requests, kernels


def _group(name: str) -> str:
    head, sep, tail = name.rpartition(" #")
    return head if sep and tail.isdigit() else name


class _Finder:
    """The range on a track holding a time (a flow's end binds to it)."""

    def __init__(self, ranges: Sequence[Event]) -> None:
        self.by: dict[Track, tuple[list[float], list[Event]]] = {}
        for e in sorted(ranges, key=lambda e: e["ts"]):
            starts, evs = self.by.setdefault((e["pid"], e["tid"]), ([], []))
            starts.append(e["ts"])
            evs.append(e)

    def at(self, e: Event) -> Event | None:
        found = self.by.get((e["pid"], e["tid"]))
        if found is None:
            return None
        starts, evs = found
        i = bisect.bisect_right(starts, e["ts"]) - 1
        while i >= 0 and evs[i]["ts"] + evs[i]["dur"] < e["ts"]:
            i -= 1  # nested or earlier: look back a little
            if i < len(evs) - 64:
                return None
        return evs[i] if i >= 0 else None


def collect(
    v: _View,
    events: Sequence[Event],
    lo: float,
    hi: float,
    palette: Callable[[int], tuple[float, float, float, float]],
) -> Served:
    """The served rows of a checked trace in the window [lo, hi] (µs), and up to
    ``MAX_CHAINS`` chains, spread over the window's batches."""
    inside = [e for e in v.serving if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    groups: dict[str, list[Event]] = {}
    lanes: dict[str, set[Track]] = {}
    for e in inside:
        g = _group(v.track_name((e["pid"], e["tid"])))
        groups.setdefault(g, []).append(e)
        lanes.setdefault(g, set()).add((e["pid"], e["tid"]))
    order = sorted(groups, key=lambda g: (" batches" in g, g))
    members = {k: i for i, g in enumerate(order) for k in lanes[g]}
    labels = []
    for g in order:
        n, unit = len(groups[g]), "batch" if " batches" in g else "request"
        plural = "batches" if unit == "batch" else "requests"
        labels.append(f"{g}  {n} {unit if n == 1 else plural}")
    finder = _Finder([*v.serving, *v.device])
    starts = {e["id"]: e for e in events if e["ph"] == "s" and e.get("cat") == SERVE}
    into: dict[int, list[Event]] = {}  # id(batch) -> kernels; id(request) -> [batch]
    came: dict[int, list[Event]] = {}  # id(batch) -> its requests
    for f in events:
        if f["ph"] != "f" or f.get("cat") != SERVE or f["id"] not in starts:
            continue
        a, b = finder.at(starts[f["id"]]), finder.at(f)
        if a is None or b is None:
            continue
        into.setdefault(id(a), []).append(b)
        if b.get("cat") == SERVE:
            came.setdefault(id(b), []).append(a)
    batches = [
        e for e in inside if id(e) in into and " batches" in v.track_name((e["pid"], e["tid"]))
    ]
    picked = _spread(len(batches), MAX_CHAINS)
    chains = []
    for n, i in enumerate(picked):
        b = batches[i]
        number = (b.get("args") or {}).get("batch", -1)
        kernels = [k for k in into[id(b)] if k.get("cat") != SERVE]
        kernels += [
            k for k in v.device if (k.get("args") or {}).get("batch") == number and k not in kernels
        ]
        requests = came.get(id(b), [])
        chain = Chain(
            batch=b["name"],
            number=number,
            requests=len(requests),
            kernels=tuple(k["name"] for k in kernels),
            color=palette(n),
        )
        chains.append((chain, b, requests, kernels))
    return Served(
        rows=tuple(order),
        labels=tuple(labels),
        members=members,
        ranges=inside,
        chains=chains,
    )


def _spread(n: int, cap: int) -> list[int]:
    if n <= cap:
        return list(range(n))
    return sorted({round((i + 0.5) * n / cap) for i in range(cap)} - {n})


def draw(
    ax: Any,
    served: Served,
    x: Callable[[float], float],
    scale: float,
    first_row: int,
    device_rows: Mapping[Track, int],
) -> list[Any]:
    """Draw the served rows from ``first_row`` down and the chains; the legend handles."""
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Patch

    bars: dict[int, list[tuple[float, float]]] = {}
    for e in served.ranges:
        bars.setdefault(served.members[e["pid"], e["tid"]], []).append(
            (x(e["ts"]), e["dur"] / scale)
        )
    for r, spans in bars.items():
        ax.broken_barh(spans, (first_row + r - 0.3, 0.6), facecolors="0.6", alpha=0.35, lw=0)
    handles = []
    for chain, b, requests, kernels in served.chains:
        c = chain.color

        def at(e: Event) -> tuple[float, float] | None:
            k = (e["pid"], e["tid"])
            if k in served.members:
                return x(e["ts"] + e["dur"] / 2), first_row + served.members[k]
            if k in device_rows:
                return x(e["ts"] + e["dur"] / 2), device_rows[k]
            return None

        for e in [b, *requests]:
            row = first_row + served.members.get((e["pid"], e["tid"]), 0)
            ax.broken_barh(
                [(x(e["ts"]), e["dur"] / scale)], (row - 0.3, 0.6), facecolors=[c], zorder=3
            )
        for k in kernels:
            p = at(k)
            if p is not None:
                ax.broken_barh(
                    [(x(k["ts"]), k["dur"] / scale)],
                    (p[1] - 0.45, 0.9),
                    facecolors="none",
                    edgecolors=[c],
                    lw=1.2,
                    zorder=4,
                )
        mid = at(b)
        segs = [[p, mid] for p in map(at, requests) if p is not None and mid is not None]
        segs += [[mid, p] for p in map(at, kernels) if p is not None and mid is not None]
        ax.add_collection(LineCollection(segs, colors=[c], linewidths=0.9, alpha=0.9, zorder=5))
        label = (
            f"batch {chain.number}: {chain.requests} requests -> {len(chain.kernels)} device ranges"
        )
        handles.append(Patch(color=c, label=label))
    return handles
