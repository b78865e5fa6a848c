"""aiohttp (asyncio) awaiting an hcqa pipeline through a batcher: devices opened in a
cleanup context.

    pip install aiohttp
    python examples/aiohttp_app.py --port 8080
    curl -s -d '{"inputs": [1, 2, 3, 4]}' localhost:8080/infer                # one sample
    curl -s -d '{"inputs": [[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0]]}' localhost:8080/infer

``POST /infer`` takes JSON ``{"inputs": float32[4]}`` (one sample) or ``{"inputs":
float32[n, 4]}`` (a batch of any ``n >= 1``) and returns the pipeline's output for it:
stage 1 on ``cpu:0`` adds 1, stage 2 on ``cpu:1`` doubles, so ``(x + 1) * 2``. The
pipeline runs batches of ``IN_SHAPE[0]`` rows: each whole batch of a request goes straight
to it, and each row left over (a lone sample, an odd row) through ``hcqa.open_batcher``,
which gathers such rows of concurrent requests into full batches (``infer_rows``).

A client that disconnects cancels its request, as in ``hcqa serve``: aiohttp cancels the
handler of a client that has gone only when asked to (``handler_cancellation=True``, off by
default), and the ``CancelledError`` then reaches the pipeline and batcher calls, which stop
the work (a call still waiting for a slot, or a row for its batch, never runs). Run the app
with :data:`SERVER_OPTIONS` (``web.run_app(app, **SERVER_OPTIONS)``, or
``web.AppRunner(app, **SERVER_OPTIONS)``).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from aiohttp import web

import hcqa

IN_SHAPE = (2, 4)  # the pipeline's batch: 2 rows of 4
MAX_ROWS = 4096  # rows in one request (each is a batcher call)
PIPE = web.AppKey("pipe", hcqa.Pipeline)
BATCH = web.AppKey("batch", hcqa.Batcher)
# Cancel the handler when its client disconnects: nothing is computed for nobody.
SERVER_OPTIONS: dict[str, Any] = {"handler_cancellation": True}


def add_one(out: np.ndarray, x: np.ndarray) -> None:
    np.add(x, 1, out=out)


def double(out: np.ndarray, x: np.ndarray) -> None:
    np.multiply(x, 2, out=out)


async def devices(app: web.Application) -> AsyncIterator[None]:
    """Open the devices and the batcher at startup, close them at cleanup."""
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        app[PIPE] = hcqa.Pipeline([(d0, add_one), (d1, double)], in_shape=IN_SHAPE)
        async with hcqa.open_batcher(app[PIPE], max_wait=0.002) as batch:
            app[BATCH] = batch
            yield


async def infer_rows(pipe: Any, batch: hcqa.Batcher, rows: np.ndarray) -> np.ndarray:
    """``rows`` (``[n, 4]``, any ``n >= 1``) through the model, in order: each whole batch
    of the pipeline's rows straight to it, each row left over through the batcher."""
    n = IN_SHAPE[0]
    whole = len(rows) - len(rows) % n
    calls = [pipe(rows[i : i + n]) for i in range(0, whole, n)]
    calls += [batch(row) for row in rows[whole:]]
    outs = await asyncio.gather(*calls)
    return np.concatenate([o if o.ndim == rows.ndim else o[None] for o in outs])


async def infer(request: web.Request) -> web.Response:
    try:
        doc: Any = await request.json()
        x = np.asarray(doc["inputs"], dtype=np.float32)
        if x.ndim not in (1, 2) or not 1 <= len(x) <= MAX_ROWS:
            raise hcqa.InvalidCommand(
                f"inputs must be one sample or a batch of 1 to {MAX_ROWS} samples "
                f"(got shape {list(x.shape)})"
            )
        rows = x[None] if x.ndim == 1 else x  # one sample is a batch of one row
        y = await infer_rows(request.app[PIPE], request.app[BATCH], rows)
    except (ValueError, KeyError, TypeError, hcqa.InvalidCommand) as exc:
        return web.json_response({"error": type(exc).__name__, "detail": str(exc)}, status=400)
    return web.json_response({"outputs": (y[0] if x.ndim == 1 else y).tolist()})


def make_app() -> web.Application:
    app = web.Application()
    app.cleanup_ctx.append(devices)
    app.router.add_post("/infer", infer)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="aiohttp serving an hcqa pipeline")
    parser.add_argument("--port", type=int, default=8080)
    web.run_app(make_app(), host="127.0.0.1", port=parser.parse_args().port, **SERVER_OPTIONS)
