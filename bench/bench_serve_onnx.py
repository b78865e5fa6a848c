"""Serving an ONNX model: ``hcqa serve --model`` vs Ray Serve and FastAPI hosting the same session.

Run from the repository root (under the shared bench lock on a shared host)::

    python -m bench.bench_serve_onnx            # 4 rounds of 4 s per server
    python -m bench.bench_serve_onnx --quick    # 2 rounds of 2 s: indicative only
    python -m bench.bench_serve_onnx --no-ray   # without the Ray Serve peer
    python -m bench.bench_serve_onnx --hidden 16384 --no-ray   # a device-bound model
    python -m bench.bench_serve_onnx --depth 1  # one batch at a time on the device

The model is an MLP written with ``onnx.helper`` (``x[N, 256] -> Gemm 512 -> Relu -> Gemm 256``,
float32, seeded weights), saved to a temporary file and served two ways on loopback, each in
its own process with one BLAS thread:

* **hcqa**: ``hcqa serve --model mlp=PATH --backend onnxruntime --max-batch 32`` -- the session
  as one kernel on ``cpu:0`` (one intra-op thread), single samples gathered by the dynamic
  batcher into batches of up to 32 rows (the captured sizes 1, 2, 4, ..., 32), two batches
  in flight (``--depth``: the next one queued on the device while one runs);
* **FastAPI**: ``examples/fastapi_onnx_app.py`` on uvicorn -- the same file, the same session
  options, each request's ``session.run`` on one row in Starlette's thread pool (no batching,
  as such deployments usually run);
* **Ray Serve**: ``bench/_ray_serve_app.py --onnx PATH`` -- one replica whose ``@serve.batch``
  method (the same ``max_batch_size`` 32 and 2 ms wait as hcqa) runs the gathered samples as
  one ``session.run`` of the same session options; Ray kept small (``num_cpus=2``, no
  dashboard, no log shipping).

64 closed-loop clients (``bench.bench_serve``'s raw keep-alive HTTP/1.1 client, in this
process) each POST one raw float32[256] sample to ``/infer``, wait for the answer, check it
against onnxruntime run here, and send the next. The servers alternate, round by round (the
order flipped each round), so the host's load hits both alike. Reported per server: throughput
and latency p50 / p99 summed over the rounds, and the median of the per-round ratios.

Targets: hcqa's throughput >= 1.0x FastAPI's; >= 3x Ray Serve's with a p99 <= 0.5x its.

Then one more window of hcqa alone, traced (``HCQA_TRACE``): the share of that window in which
the device queue ran a range (the scheduler keeps the device fed: target >= 90 %), read from
the trace the server writes when it stops, and the traced throughput beside the untraced one.
The default MLP's kernel is ~0.1 ms a batch: the host's HTTP work, not the device, bounds the
throughput, so the device idles whatever the scheduler does. ``--hidden 16384`` makes the
kernel the bottleneck (~64x the work a row), the case where the share says whether the
scheduler keeps the device fed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from bench._util import markdown_table, percentile, print_footer
from bench.bench_serve import ROOT, Server, run_clients

WIDTH, HIDDEN, MAX_BATCH, CLIENTS = 256, 512, 32, 64


def build_model(path: Path, hidden: int = HIDDEN) -> Path:
    """The bench's MLP as an ONNX file (seeded weights, a symbolic batch)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name
        )
        for name, shape in (("W1", (WIDTH, hidden)), ("W2", (hidden, WIDTH)))
    ]
    inits += [
        numpy_helper.from_array(np.zeros(hidden, np.float32), "B1"),
        numpy_helper.from_array(np.zeros(WIDTH, np.float32), "B2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "B1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "W2", "B2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", WIDTH])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def reference(path: Path, xs: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(None, {"x": x[None]})[0] for x in xs])


async def closed_loop(
    port: int, bodies: list[bytes], want: np.ndarray, seconds: float, warmup: float
) -> tuple[list[float], int]:
    """``CLIENTS`` closed-loop clients on ``POST /infer`` (both servers take raw rows there)."""
    return await run_clients(
        port, "/infer", bodies, want, clients=CLIENTS, seconds=seconds, warmup=warmup
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 s")
    parser.add_argument(
        "--hidden",
        type=int,
        default=HIDDEN,
        help=f"the MLP's hidden width (default {HIDDEN}; 16384 makes the device the bottleneck)",
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=2,
        help="batches hcqa keeps in flight on the model's device (default 2; 1: one at a time)",
    )
    parser.add_argument("--no-ray", action="store_true", help="without the Ray Serve peer")
    parser.add_argument("--no-trace", action="store_true", help="without the traced window")
    args = parser.parse_args(argv)
    rounds, seconds, warmup = (2, 2.0, 0.5) if args.quick else (4, 4.0, 1.0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "mlp.onnx", args.hidden)
        xs = np.random.default_rng(1).standard_normal((64, WIDTH)).astype(np.float32)
        want = reference(path, xs)
        bodies = [x.astype("<f4").tobytes() for x in xs]
        hcqa_argv = [sys.executable, "-m", "hcqa.cli", "serve", "--port", "0"]
        hcqa_argv += ["--model", f"mlp={path}", "--backend", "onnxruntime", "--device", "cpu"]
        hcqa_argv += ["--max-batch", str(MAX_BATCH), "--max-pending", "1024"]
        hcqa_argv += ["--access-log", "none", "--depth", str(args.depth)]
        peer_argv = [sys.executable, str(ROOT / "examples" / "fastapi_onnx_app.py")]
        peer_argv += ["--model", str(path), "--port", "0"]
        starts = [
            ("hcqa serve", hcqa_argv, r"http://127\.0\.0\.1:(\d+)"),
            ("FastAPI + uvicorn", peer_argv, r"FASTAPI READY (\d+)"),
        ]
        if not args.no_ray:  # Ray Serve needs ray[serve]'s grpcio (the bench extra)
            ray_argv = [sys.executable, str(ROOT / "bench" / "_ray_serve_app.py")]
            ray_argv += ["--onnx", str(path), "--max-batch", str(MAX_BATCH)]
            starts.append(("Ray Serve", ray_argv, r"RAY SERVE READY (\d+)"))
        servers: list[Server] = []
        results: dict[str, dict[str, Any]] = {
            name: {"lat": [], "n": 0, "errors": 0, "rates": []} for name, _, _ in starts
        }
        try:
            for name, argv, ready in starts:  # inside the try: a failed start stops the others
                servers.append(Server(name, argv, ready=ready))
            for r in range(rounds):
                order = servers if r % 2 == 0 else servers[::-1]
                for s in order:
                    lat, errors = trio.run(closed_loop, s.port, bodies, want, seconds, warmup)
                    res = results[s.name]
                    res["lat"] += lat
                    res["errors"] += errors
                    res["rates"].append(len(lat) / seconds)
                    print(
                        f"  round {r + 1}, {s.name}: {len(lat) / seconds:.0f} req/s, "
                        f"{errors} errors",
                        flush=True,
                    )
        finally:
            for s in servers:
                s.stop()
        traced = None if args.no_trace else traced_window(hcqa_argv, bodies, want, seconds, warmup)
    rows = []
    for name, res in results.items():
        lat = res["lat"]
        rate = len(lat) / (seconds * rounds)
        rows.append(
            [
                name,
                f"{rate:.0f}",
                f"{percentile(lat, 50) * 1e3:.2f}",
                f"{percentile(lat, 99) * 1e3:.2f}",
                res["errors"],
            ]
        )
    print()
    print(markdown_table(["server", "req/s", "p50 ms", "p99 ms", "errors"], rows))
    a = results["hcqa serve"]
    lines = []
    for peer, floor, p99_cap in (("FastAPI + uvicorn", 1.0, None), ("Ray Serve", 3.0, 0.5)):
        if peer not in results:
            continue
        b = results[peer]
        ratios = [x / y for x, y in zip(a["rates"], b["rates"], strict=True) if y]
        ratio = float(np.median(ratios)) if ratios else float("nan")
        p99 = percentile(a["lat"], 99) / percentile(b["lat"], 99)
        verdict = "met" if ratio >= floor else "MISSED"
        p99_note = ""
        if p99_cap is not None:
            p99_note = f" (target <= {p99_cap}x: {'met' if p99 <= p99_cap else 'MISSED'})"
        lines.append(
            f"hcqa serve / {peer} throughput at {CLIENTS} clients: {ratio:.2f}x (median of "
            f"{len(ratios)} per-round ratios; target >= {floor}x: {verdict}); p99 {p99:.2f}x "
            f"{peer}'s{p99_note}"
        )
    if traced is not None:
        share, rate, ranges = traced
        untraced = len(a["lat"]) / (seconds * rounds)
        verdict = "met" if share >= 0.9 else "MISSED"
        lines.append(
            f"device busy share in the traced window of hcqa serve: {100 * share:.1f} % of "
            f"{seconds:g} s ({ranges} device ranges; target >= 90 %: {verdict}); traced "
            f"{rate:.0f} req/s vs {untraced:.0f} untraced"
        )
    print_footer(None, lines, started)


def traced_window(
    argv: list[str], bodies: list[bytes], want: np.ndarray, seconds: float, warmup: float
) -> tuple[float, float, int]:
    """One more closed-loop window of ``hcqa serve`` run with ``HCQA_TRACE``: the share of
    the measured window in which a device queue ran a range (from the trace it writes when
    stopped), its throughput, and how many device ranges fell in the window."""
    from hcqa.trace import load
    from hcqa.trace.reading import _busy, _clip, _view

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "serve-trace.json"
        s = Server(
            "hcqa serve (traced)",
            argv,
            ready=r"http://127\.0\.0\.1:(\d+)",
            env={"HCQA_TRACE": str(trace)},
        )
        try:
            lo_ns = time.monotonic_ns() + int(warmup * 1e9)  # run_clients times from here
            lat, errors = trio.run(closed_loop, s.port, bodies, want, seconds, warmup)
            hi_ns = lo_ns + int(seconds * 1e9)
        finally:
            s.stop()
        doc = load(trace)
    origin = doc["otherData"]["origin_ns"]
    lo, hi = (lo_ns - origin) / 1e3, (hi_ns - origin) / 1e3  # the trace's µs
    spans = [(e["ts"], e["dur"]) for e in _view(doc).device]
    inside = _clip(spans, lo, hi)
    dropped = doc["otherData"].get("dropped_events", 0)
    print(
        f"  traced round, hcqa serve: {len(lat) / seconds:.0f} req/s, {errors} errors, "
        f"{dropped} trace events dropped"
    )
    return _busy(inside) / (hi - lo), len(lat) / seconds, len(inside)


if __name__ == "__main__":
    main()
