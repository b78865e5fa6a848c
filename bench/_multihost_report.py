"""The multi-host benchmark's report: per-round ratios of hcqa against Ray Compiled Graphs.

``bench_multihost`` collects each round's JSON lines from both sides and hands them here: a
table of the medians over rounds (latency p50 / p99, items/s, idle CPU of each group of
processes, Ray's daemons apart), hcqa's ratios to Ray CG taken per round and their median
(``SPEC`` names each row and its direction), one line per target, and each round's numbers."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bench._util import markdown_table

LATENCY_TARGET = 0.5  # hcqa p50 / Ray CG p50 at most
THROUGHPUT_TARGET = 2.0  # hcqa items/s / Ray CG items/s at least
IDLE_TARGET = 5.0  # % of one core, all hcqa processes together


def _num(r: dict[str, Any], key: str) -> float | None:
    v = r.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _median(rounds: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [v for v in (_num(r, key) for r in rounds) if v is not None]
    return statistics.median(vals) if vals else None


def _ratio(
    hc: Sequence[dict[str, Any]], cg: Sequence[dict[str, Any]], key: str, cg_key: str = ""
) -> float | None:
    """Median over rounds of hcqa's ``key`` / CG's ``cg_key`` (default ``key``), each
    round's pair measured side by side."""
    ratios = []
    for h, c in zip(hc, cg, strict=False):
        a, b = _num(h, key), _num(c, cg_key or key)
        if a is not None and b is not None and b > 0:
            ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "–"
    if unit == "us":
        return f"{v:,.0f} µs"
    if unit == "ips":
        return f"{v:,.0f}/s"
    if unit == "pct":
        return f"{v:.1f} %"
    return f"{v * 1e3:,.0f} ms" if v < 1 else f"{v:.2f} s"


SPEC = (
    ("lat_small_p50", "latency p50, 16 float32", "us", f"≤ {LATENCY_TARGET}x CG"),
    ("lat_small_p99", "latency p99, 16 float32", "us", ""),
    ("lat_big_p50", "latency p50, 4 MiB", "us", f"≤ {LATENCY_TARGET}x CG"),
    ("lat_big_p99", "latency p99, 4 MiB", "us", ""),
    ("floor_cg_small", "floor: 1 cross-node CG hop, driver -> node_b -> driver, 16 f32", "us", ""),
    ("floor_call_small", "floor: 1 sync actor call to node_b, 16 f32", "us", ""),
    ("floor_cg_big", "floor: 1 cross-node CG hop, 4 MiB", "us", ""),
    ("floor_call_big", "floor: 1 sync actor call to node_b, 4 MiB", "us", ""),
    ("tput_small", "items/s, 10 in flight, 16 float32", "ips", f"≥ {THROUGHPUT_TARGET}x CG"),
    ("tput_big", "items/s, 10 in flight, 4 MiB", "ips", f"≥ {THROUGHPUT_TARGET}x CG"),
    ("idle_cpu", "CPU idle 2 s: driver + actors + workers", "pct", f"hcqa < {IDLE_TARGET} %"),
    ("idle_cpu:driver", "  of which the driver", "pct", ""),
    ("idle_cpu:actors", "  of which the actors", "pct", ""),
    ("idle_cpu:workers", "  of which process-pipeline workers", "pct", ""),
    ("idle_cpu:ray-daemons", "CPU idle 2 s: Ray's daemons (GCS, raylets, idle workers)", "pct", ""),
    ("setup_s", "setup: open the pipeline / compile the graph", "s", ""),
    ("teardown_s", "close the pipeline / teardown the graph", "s", ""),
    ("init_s", "start the 2-node cluster (not measured in the above)", "s", ""),
)


def report(hc: Sequence[dict[str, Any]], cg: Sequence[dict[str, Any]]) -> bool:
    """Print the table and the verdicts; True when every judged target was met."""
    rows = []
    for key, label, unit, target in SPEC:
        h, c = _median(hc, key), _median(cg, key)
        if h is None and c is None:
            continue
        ratio = None if unit == "pct" else _ratio(hc, cg, key)
        shown = "–" if ratio is None else f"{ratio:.2f}x"
        rows.append([label, _fmt(h, unit), _fmt(c, unit), shown, target])
    print(
        markdown_table(
            ["metric", "hcqa over Ray", "Ray Compiled Graphs", "hcqa/CG", "target"], rows
        )
    )
    print()
    for size, what in (("small", "16 float32"), ("big", "4 MiB")):
        over = [
            f"{_ratio(hc, cg, f'lat_{size}_p50', f'floor_{k}_{size}') or float('nan'):.2f}x {name}"
            for k, name in (("cg", "a CG hop"), ("call", "an actor call"))
        ]
        print(f"hcqa latency p50 {what} over one cross-node round trip: {', '.join(over)}")
    print()
    verdicts: list[bool] = []

    def verdict(line: str, ok: bool | None) -> None:
        if ok is not None:
            verdicts.append(ok)
        print(f"- {line}: {'n/a' if ok is None else ('met' if ok else 'MISSED')}")

    for key, what in (("lat_small_p50", "16 float32"), ("lat_big_p50", "4 MiB")):
        r = _ratio(hc, cg, key)
        verdict(
            f"latency p50 {what} ≤ {LATENCY_TARGET}x CG's ({'–' if r is None else f'{r:.2f}x'})",
            None if r is None else r <= LATENCY_TARGET,
        )
    for key, what in (("tput_small", "16 float32"), ("tput_big", "4 MiB")):
        r = _ratio(hc, cg, key)
        verdict(
            f"items/s {what} ≥ {THROUGHPUT_TARGET}x CG's ({'–' if r is None else f'{r:.2f}x'})",
            None if r is None else r >= THROUGHPUT_TARGET,
        )
    idle = _median(hc, "idle_cpu")
    verdict(
        f"idle CPU of hcqa's processes < {IDLE_TARGET} % of a core ({_fmt(idle, 'pct')})",
        None if idle is None else idle < IDLE_TARGET,
    )
    return all(verdicts) and bool(verdicts)


def _per_round(name: str, rounds: Sequence[dict[str, Any]]) -> str:
    keys = ("lat_small_p50", "lat_big_p50", "tput_small", "tput_big", "idle_cpu")
    parts = []
    for r in rounds:
        vals = [f"{k}={r[k]:.4g}" if _num(r, k) is not None else f"{k}=–" for k in keys]
        parts.append(" ".join(vals))
    return f"{name}: " + " | ".join(parts)
