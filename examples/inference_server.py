"""An async inference server with hcqa: your own two-stage pipeline, served over HTTP.

Stage 1 (on ``cpu:0``) standardises each row of a batch; stage 2 (on ``cpu:1``) is a linear
classifier with a softmax. ``hcqa.serve.serve`` runs a Starlette app under hcqa's HTTP
server in the same trio run as the devices: single samples from concurrent clients are
batched dynamically (``hcqa.open_batcher``) into the pipeline's batches of ``BATCH`` rows,
while ``GET /health`` and ``GET /metrics`` keep answering at once. SIGTERM or Ctrl-C drains:
the server stops accepting, finishes the requests in flight, and the script exits 0 as soon as
they are answered. A second signal stops at once: it cancels the scope around the devices,
so work still queued on them is dropped rather than run.

    pip install -e '.[serve]'
    python examples/inference_server.py            # serves on http://127.0.0.1:8000

    curl -s localhost:8000/health
    curl -s localhost:8000/stats
    python -c 'import json; print(json.dumps({"inputs": [[(i * j + j * j) % 11
        for j in range(16)] for i in range(4)]}))' > x.json
    curl -s -H 'Content-Type: application/json' -d @x.json localhost:8000/infer
    curl -s -H 'Content-Type: application/json' -d '{"inputs": [1, 2, 3, 4, 5, 6, 7, 8,
        9, 10, 11, 12, 13, 14, 15, 16]}' localhost:8000/infer       # one sample, batched
    curl -s localhost:8000/metrics
"""

from __future__ import annotations

import signal
import sys

import numpy as np
import trio

import hcqa
from hcqa.serve import serve

BATCH, FEATURES, CLASSES = 4, 16, 3


def standardize(out: np.ndarray, x: np.ndarray) -> None:
    """Stage 1: each row to zero mean and unit variance."""
    mean = x.mean(axis=1, keepdims=True)
    std = x.std(axis=1, keepdims=True) + 1e-6
    np.divide(x - mean, std, out=out)


def classify(out: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """Stage 2: class probabilities, softmax(x @ w)."""
    logits = x @ w
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.divide(e, e.sum(axis=1, keepdims=True), out=out)


async def build_pipeline(d0: hcqa.Device, d1: hcqa.Device) -> hcqa.Pipeline:
    weights = d1.alloc(shape=(FEATURES, CLASSES), dtype="float32")
    rng = np.random.default_rng(0)
    await weights.copyin(rng.standard_normal((FEATURES, CLASSES), dtype=np.float32))
    stages = [
        hcqa.Stage(device=d0, program=standardize, name="standardize"),
        hcqa.Stage(device=d1, program=classify, params=(weights,), out_shape=(BATCH, CLASSES)),
    ]
    return hcqa.Pipeline(stages, in_shape=(BATCH, FEATURES), depth=2)


async def main(port: int) -> None:
    stop = trio.Event()
    everything = trio.CancelScope()  # a second signal cancels it, devices included
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals, everything:
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1), trio.open_nursery() as nursery:
            pipe = await build_pipeline(d0, d1)

            async def on_signal() -> None:
                async for _ in signals:
                    if stop.is_set():
                        print("stopping now")
                        everything.cancel()
                        return
                    print("draining: finishing the requests in flight")
                    stop.set()

            nursery.start_soon(on_signal)
            print(f"serving {pipe} on http://127.0.0.1:{port} (Ctrl-C drains and stops)")
            await serve(
                pipe, host="127.0.0.1", port=port, max_wait=0.002, shutdown_trigger=stop.wait
            )
            nursery.cancel_scope.cancel()
    print("stopped")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 8000)
