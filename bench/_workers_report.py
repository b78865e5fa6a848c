"""The process-pipeline benchmark's report: each side's rounds, their medians, ratios and targets.

``bench_workers`` collects the JSON lines of every round of each side (hcqa, Ray Compiled
Graphs) and hands them here: a table of medians over rounds (latency p50 / p99, items/s, idle
and busy CPU, teardown), hcqa's ratios against Ray's, one line per target (met or missed), and
each round's raw numbers, so a noisy round shows."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from bench._procs import (
    Value,
)
from bench._util import markdown_table

LATENCY_TARGET = 0.3  # hcqa p50 / Ray p50 at most
THROUGHPUT_TARGET = 3.0  # hcqa items/s / Ray items/s at least
IDLE_TARGET = 5.0  # % of one core, all hcqa processes together
TEARDOWN_TARGET = 1.0  # seconds


def _median(rounds: Sequence[dict[str, Any]], key: str) -> Value | None:
    vals = [r[key] for r in rounds if key in r]
    if not vals:
        return None
    nums = [float(v) for v in vals if isinstance(v, int | float)]
    bad = [v for v in vals if not isinstance(v, int | float)]
    if bad:
        hung = sum(1 for v in bad if v == "hung")
        what = "hung" if hung == len(bad) else str(bad[0])
        note = f"{what} in {len(bad)}/{len(vals)} rounds"
        return note + (f" (others {statistics.median(nums):.3g})" if nums else "")
    return statistics.median(nums)


def _fmt(v: Value | None, unit: str) -> str:
    if v is None:
        return "–"
    if isinstance(v, str):
        return v
    if unit == "us":
        return f"{v:,.0f} µs"
    if unit == "ips":
        return f"{v:,.0f}/s"
    if unit == "pct":
        return f"{v:.1f} %"
    if unit == "s":
        return f"{v * 1e3:,.0f} ms" if v < 1 else f"{v:.2f} s"
    return f"{v:.3g}"


def _ratio(h: Value | None, r: Value | None) -> float | None:
    if isinstance(h, int | float) and isinstance(r, int | float) and r > 0:
        return float(h) / float(r)
    return None


def report(hc: Sequence[dict[str, Any]], ry: Sequence[dict[str, Any]], with_ray: bool) -> bool:
    """Print the table and the verdicts; True when every judged target was met."""

    def m(side: Sequence[dict[str, Any]], key: str) -> Value | None:
        return _median(side, key) if side else None

    rows: list[list[str]] = []
    ratios: dict[str, float | None] = {}
    spec = [
        ("lat_small_p50", "latency p50, 16 float32", "us", f"≤ {LATENCY_TARGET}x Ray"),
        ("lat_small_p99", "latency p99, 16 float32", "us", ""),
        ("ring_p50", "floor: bare 3-process eventfd ring (trio + 2 plain), p50", "us", ""),
        ("lat_big_p50", "latency p50, 4 MiB (result lent)", "us", f"≤ {LATENCY_TARGET}x Ray"),
        ("lat_big_p99", "latency p99, 4 MiB (result lent)", "us", ""),
        ("lat_big_copy_p50", "latency p50, 4 MiB, result copied out", "us", ""),
        ("lat_big_copy_p99", "latency p99, 4 MiB, result copied out", "us", ""),
        ("lat_big_zc_p50", "latency p50, 4 MiB, zero-copy `pipe.item()`", "us", ""),
        ("lat_big_zc_p99", "latency p99, 4 MiB, zero-copy `pipe.item()`", "us", ""),
        ("tput_small", "items/s, 10 in flight, 16 float32", "ips", f"≥ {THROUGHPUT_TARGET}x Ray"),
        ("tput_big", "items/s, 10 in flight, 4 MiB", "ips", ""),
        ("tput_big_zc", "items/s, 10 in flight, 4 MiB, zero-copy `pipe.item()`", "ips", ""),
        ("idle_cpu", "CPU idle 2 s: coordinator/driver + 2 workers", "pct", f"< {IDLE_TARGET} %"),
        ("idle_cpu:ray-daemons", "CPU idle 2 s: Ray daemons (raylet, GCS, ...)", "pct", ""),
        ("busy_cpu", "CPU while stage 1 sleeps 1 s: coordinator + workers", "pct", ""),
        ("busy_cpu:ray-daemons", "CPU while stage 1 sleeps 1 s: Ray daemons", "pct", ""),
        ("teardown_small", "teardown, 10 in flight, 16 float32", "s", f"< {TEARDOWN_TARGET} s"),
        ("teardown_big", "teardown, 10 in flight, 4 MiB", "s", f"< {TEARDOWN_TARGET} s"),
        ("setup_small", "setup: open pipeline / compile graph", "s", ""),
        ("init_s", "setup: ray.init", "s", ""),
        ("shutdown_s", "ray.shutdown", "s", ""),
    ]
    for key, label, unit, target in spec:
        h, r = m(hc, key), m(ry, key)
        if h is None and r is None:
            continue
        ratio = _ratio(h, r) if unit != "pct" else None  # a ratio of ~0 % says nothing
        ratios[key] = ratio
        rows.append(
            [label, _fmt(h, unit), _fmt(r, unit), "–" if ratio is None else f"{ratio:.2f}x", target]
        )
    print(markdown_table(["metric", "hcqa", "Ray Compiled Graphs", "hcqa/Ray", "target"], rows))

    def pct_breakdown(side: Sequence[dict[str, Any]], key: str) -> str:
        parts = []
        for grp in ("coordinator", "workers", "driver", "actors"):
            v = m(side, f"{key}:{grp}")
            if v is not None:
                parts.append(f"{grp} {_fmt(v, 'pct')}")
        return ", ".join(parts)

    print()
    for key, what in (("idle_cpu", "idle"), ("busy_cpu", "stage sleeping 1 s")):
        print(f"CPU {what}: hcqa {pct_breakdown(hc, key)}; Ray {pct_breakdown(ry, key) or '–'}")
    print()
    floor, small, ray_small = m(hc, "ring_p50"), m(hc, "lat_small_p50"), m(ry, "lat_small_p50")
    if isinstance(floor, float) and isinstance(small, float):
        line = f"16-float latency over the bare eventfd ring floor: hcqa {small / floor:.2f}x"
        if isinstance(ray_small, float):
            line += f", Ray {ray_small / floor:.2f}x"
        print(line)
        print()

    verdicts: list[bool] = []

    def verdict(line: str, ok: bool | None) -> None:
        if ok is not None:
            verdicts.append(ok)
        state = "n/a" if ok is None else ("met" if ok else "MISSED")
        print(f"- {line}: {state}")

    ray_big = m(ry, "lat_big_p50")
    for key in ("lat_big_zc_p50", "lat_big_copy_p50"):
        h = m(hc, key)
        if isinstance(h, float) and isinstance(ray_big, float):
            ratios[key] = h / ray_big
    for key, what in (
        ("lat_small_p50", "16 float32"),
        ("lat_big_p50", "4 MiB, `await pipe(x)` (copy in, result lent)"),
        ("lat_big_copy_p50", "4 MiB, `await pipe(x)` (copy in, copy out: every loan held)"),
        ("lat_big_zc_p50", "4 MiB, zero-copy `pipe.item()` (the caller fills the slot)"),
    ):
        ratio = ratios.get(key)
        shown = "no Ray numbers" if ratio is None else f"{ratio:.2f}x Ray"
        verdict(
            f"latency {what} ≤ {LATENCY_TARGET}x Ray's ({shown})",
            None if ratio is None else ratio <= LATENCY_TARGET,
        )
    ratio = ratios.get("tput_small")
    verdict(
        f"items/s with 10 in flight ≥ {THROUGHPUT_TARGET}x Ray's "
        f"({'no Ray numbers' if ratio is None else f'{ratio:.2f}x Ray'})",
        None if ratio is None else ratio >= THROUGHPUT_TARGET,
    )
    idle = m(hc, "idle_cpu")
    verdict(
        f"idle CPU < {IDLE_TARGET} % of a core ({_fmt(idle, 'pct')})",
        isinstance(idle, float) and idle < IDLE_TARGET,
    )
    for key, what in (("teardown_small", "16 float32"), ("teardown_big", "4 MiB")):
        td = m(hc, key)
        verdict(
            f"teardown {what} < {TEARDOWN_TARGET} s ({_fmt(td, 's')})",
            isinstance(td, float) and td < TEARDOWN_TARGET,
        )
    if not with_ray:
        print("- (Ray not run: latency and throughput ratios not judged)")
    return all(verdicts)


def _per_round(name: str, rounds: Iterable[dict[str, Any]]) -> str:
    keys = ("ring_p50", "lat_small_p50", "lat_big_p50", "tput_small", "idle_cpu", "teardown_big")
    parts = []
    for r in rounds:
        vals = []
        for k in keys:
            v = r.get(k)
            vals.append(f"{k}={v:.4g}" if isinstance(v, int | float) else f"{k}={v}")
        parts.append(" ".join(vals))
    return f"{name}: " + " | ".join(parts)
