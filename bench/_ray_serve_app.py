"""The Ray Serve peer of ``bench/bench_serve.py``: the same MLP behind ``@serve.batch``.

Run by the bench as a process of its own: starts a local Ray session (loopback only, no
dashboard), deploys one replica on ``127.0.0.1:PORT/infer``, prints ``RAY SERVE READY PORT``
and serves until SIGTERM, then shuts Ray down. The replica's ``@serve.batch`` method gets
the single samples gathered by Ray Serve (``max_batch_size`` and ``batch_wait_timeout_s`` the
same as hcqa's ``--max-batch`` and ``--max-wait``) and runs ``relu(x @ w1) @ w2`` on them
with the weights of ``hcqa.serve.mlp_pipeline`` (seed 0).

``--onnx PATH`` (``bench/bench_serve_onnx.py``'s peer): the replica hosts an onnxruntime
session of that file instead (one intra-op thread, the options of
``examples/fastapi_onnx_app.py``), and its ``@serve.batch`` method runs the gathered samples
as one ``session.run``. Ray is kept small for a 2-core host: ``num_cpus=2``, one replica, no
dashboard, no log shipping to the driver.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import threading
import time
from typing import Any

import numpy as np

ARGS: dict[str, Any] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait", type=float, default=0.002)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--onnx", default="", help="serve this ONNX file with onnxruntime")
    args = parser.parse_args()

    import ray
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    width, max_batch, max_wait = args.width, args.max_batch, args.max_wait
    sleep = args.sleep_ms / 1e3
    onnx_path = os.path.abspath(args.onnx) if args.onnx else ""

    @serve.deployment(num_replicas=1, max_ongoing_requests=1024)
    class MLP:
        def __init__(self) -> None:
            os.environ["OPENBLAS_NUM_THREADS"] = "1"
            self.session: Any = None
            if onnx_path:
                import onnxruntime as ort

                opts = ort.SessionOptions()
                opts.intra_op_num_threads = 1
                opts.inter_op_num_threads = 1
                self.session = ort.InferenceSession(
                    onnx_path, opts, providers=["CPUExecutionProvider"]
                )
                self.input = self.session.get_inputs()[0].name
            rng = np.random.default_rng(0)
            scale = np.float32(1 / np.sqrt(width))
            self.w1, self.w2 = (
                rng.standard_normal((width, width), dtype=np.float32) * scale for _ in range(2)
            )

        def layers(self, x: np.ndarray) -> np.ndarray:
            if self.session is not None:
                return np.asarray(self.session.run(None, {self.input: x})[0])
            if sleep:
                time.sleep(sleep)  # layer 1's kernel time, as on hcqa's cpu:0
            h = np.maximum(x @ self.w1, 0)
            if sleep:
                time.sleep(sleep)  # layer 2's, as on cpu:1
            return np.asarray(h @ self.w2)

        @serve.batch(
            max_batch_size=max_batch, batch_wait_timeout_s=max_wait, max_concurrent_batches=2
        )
        async def run(self, xs: list[np.ndarray]) -> list[np.ndarray]:
            y = await asyncio.to_thread(self.layers, np.stack(xs))
            return list(y)

        async def __call__(self, request: Request) -> Response:
            body = await request.body()
            x = np.frombuffer(body, "<f4").astype(np.float32)
            y = await self.run(x)
            return Response(y.astype("<f4").tobytes(), media_type="application/octet-stream")

    port = _free_port()
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=2,
        log_to_driver=False,
        configure_logging=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(MLP.bind(), route_prefix="/infer", name="mlp")
    print(f"RAY SERVE READY {port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
