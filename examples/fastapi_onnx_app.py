"""FastAPI on uvicorn hosting an onnxruntime session: the usual way to serve an ONNX model.

The peer of ``hcqa serve --model NAME=PATH.onnx --backend onnxruntime`` in
``bench/bench_serve_onnx.py``: the same model file, the same session options (one intra-op
and one inter-op thread, as hcqa's onnxruntime backend), and the same request as hcqa's
``POST /infer``: one sample of the model's (single) input as raw little-endian bytes,
answered as raw bytes. The endpoint runs each request's ``session.run`` in Starlette's thread
pool (what FastAPI does for a plain ``def`` endpoint; onnxruntime releases the GIL and takes
concurrent runs): no batching, as most such deployments run.

    pip install -e '.[asyncio,models]'
    python examples/fastapi_onnx_app.py --model net.onnx --port 8000
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import numpy as np
import onnxruntime as ort
from fastapi import FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

RAW_TYPE = "application/octet-stream"


def create_app(path: str) -> FastAPI:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    shape = tuple(int(d) for d in inp.shape[1:])
    dtype = np.dtype(np.float32) if inp.type == "tensor(float)" else np.dtype(np.int64)
    row_bytes = int(np.prod(shape)) * dtype.itemsize
    app = FastAPI()

    def run(body: bytes) -> Response:
        if len(body) != row_bytes:
            return Response(f"expected {row_bytes} bytes (got {len(body)})", 400)
        x = np.frombuffer(body, dtype.newbyteorder("<")).reshape((1, *shape))
        (y,) = session.run(None, {inp.name: x})
        return Response(y[0].astype(y.dtype.newbyteorder("<")).tobytes(), media_type=RAW_TYPE)

    @app.post("/infer")
    async def infer(request: Request) -> Any:
        return await run_in_threadpool(run, await request.body())

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    app = create_app(args.model)
    sock = socket.socket()
    sock.bind(("127.0.0.1", args.port))
    port = sock.getsockname()[1]
    print(f"FASTAPI READY {port}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
