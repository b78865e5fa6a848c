"""Serving an ONNX model: ``hcqa serve --model`` vs FastAPI + uvicorn hosting the same session.

Run from the repository root (under the shared bench lock on a shared host)::

    python -m bench.bench_serve_onnx            # 4 rounds of 4 s per server
    python -m bench.bench_serve_onnx --quick    # 2 rounds of 2 s: indicative only

The model is an MLP written with ``onnx.helper`` (``x[N, 256] -> Gemm 512 -> Relu -> Gemm 256``,
float32, seeded weights), saved to a temporary file and served two ways on loopback, each in
its own process with one BLAS thread:

* **hcqa**: ``hcqa serve --model mlp=PATH --backend onnxruntime --max-batch 32`` -- the session
  as one kernel on ``cpu:0`` (one intra-op thread), single samples gathered by the dynamic
  batcher into batches of up to 32 rows (the captured sizes 1, 2, 4, ..., 32);
* **FastAPI**: ``examples/fastapi_onnx_app.py`` on uvicorn -- the same file, the same session
  options, each request's ``session.run`` on one row in Starlette's thread pool (no batching,
  as such deployments usually run).

64 closed-loop clients (``bench.bench_serve``'s raw keep-alive HTTP/1.1 client, in this
process) each POST one raw float32[256] sample to ``/infer``, wait for the answer, check it
against onnxruntime run here, and send the next. The servers alternate, round by round (the
order flipped each round), so the host's load hits both alike. Reported per server: throughput
and latency p50 / p99 summed over the rounds, and the median of the per-round ratios.

Target: hcqa's throughput >= 1.0x FastAPI's (the issue's floor for this peer).
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


def build_model(path: Path) -> Path:
    """The bench's MLP as an ONNX file (seeded weights, a symbolic batch)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name
        )
        for name, shape in (("W1", (WIDTH, HIDDEN)), ("W2", (HIDDEN, WIDTH)))
    ]
    inits += [
        numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "B1"),
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
    args = parser.parse_args(argv)
    rounds, seconds, warmup = (2, 2.0, 0.5) if args.quick else (4, 4.0, 1.0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "mlp.onnx")
        xs = np.random.default_rng(1).standard_normal((64, WIDTH)).astype(np.float32)
        want = reference(path, xs)
        bodies = [x.astype("<f4").tobytes() for x in xs]
        hcqa_argv = [sys.executable, "-m", "hcqa.cli", "serve", "--port", "0"]
        hcqa_argv += ["--model", f"mlp={path}", "--backend", "onnxruntime", "--device", "cpu"]
        hcqa_argv += ["--max-batch", str(MAX_BATCH), "--max-pending", "1024"]
        hcqa_argv += ["--access-log", "none"]
        peer_argv = [sys.executable, str(ROOT / "examples" / "fastapi_onnx_app.py")]
        peer_argv += ["--model", str(path), "--port", "0"]
        servers = [
            Server("hcqa serve", hcqa_argv, ready=r"http://127\.0\.0\.1:(\d+)"),
            Server("FastAPI + uvicorn", peer_argv, ready=r"FASTAPI READY (\d+)"),
        ]
        results: dict[str, dict[str, Any]] = {
            s.name: {"lat": [], "n": 0, "errors": 0, "rates": []} for s in servers
        }
        try:
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
    a, b = (results[s.name] for s in servers)
    ratios = [x / y for x, y in zip(a["rates"], b["rates"], strict=True) if y]
    ratio = float(np.median(ratios)) if ratios else float("nan")
    p99 = percentile(a["lat"], 99) / percentile(b["lat"], 99)
    verdict = "met" if ratio >= 1.0 else "MISSED"
    lines = [
        f"hcqa serve / FastAPI throughput at {CLIENTS} clients: {ratio:.2f}x (median of "
        f"{len(ratios)} per-round ratios; target >= 1.0x: {verdict}); p99 {p99:.2f}x FastAPI's",
    ]
    print_footer(None, lines, started)


if __name__ == "__main__":
    main()
