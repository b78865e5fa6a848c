"""aiohttp (asyncio) awaiting an hcqa pipeline: devices opened in a cleanup context.

    pip install aiohttp
    python examples/aiohttp_app.py --port 8080
    curl -s -d '{"inputs": [[1, 2, 3, 4], [5, 6, 7, 8]]}' localhost:8080/infer

``POST /infer`` takes JSON ``{"inputs": float32[2, 4]}`` and returns the pipeline's output:
stage 1 on ``cpu:0`` adds 1, stage 2 on ``cpu:1`` doubles, so ``(x + 1) * 2``.

A client that disconnects cancels its request, as in ``hcqa serve``: aiohttp cancels the
handler of a client that has gone only when asked to (``handler_cancellation=True``, off by
default), and the ``CancelledError`` then reaches ``await pipe(x)``, which stops the work. Run
the app with :data:`SERVER_OPTIONS` (``web.run_app(app, **SERVER_OPTIONS)``, or
``web.AppRunner(app, **SERVER_OPTIONS)``).
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from aiohttp import web

import hcqa

IN_SHAPE = (2, 4)
PIPE = web.AppKey("pipe", hcqa.Pipeline)
# Cancel the handler when its client disconnects: nothing is computed for nobody.
SERVER_OPTIONS: dict[str, Any] = {"handler_cancellation": True}


def add_one(out: np.ndarray, x: np.ndarray) -> None:
    np.add(x, 1, out=out)


def double(out: np.ndarray, x: np.ndarray) -> None:
    np.multiply(x, 2, out=out)


async def devices(app: web.Application) -> AsyncIterator[None]:
    """Open the devices at startup, close them at cleanup (a cleanup context)."""
    async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
        app[PIPE] = hcqa.Pipeline([(d0, add_one), (d1, double)], in_shape=IN_SHAPE)
        yield


async def infer(request: web.Request) -> web.Response:
    try:
        doc: Any = await request.json()
        y = await request.app[PIPE](np.asarray(doc["inputs"], dtype=np.float32))
    except (ValueError, KeyError, TypeError, hcqa.InvalidCommand) as exc:
        return web.json_response({"error": type(exc).__name__, "detail": str(exc)}, status=400)
    return web.json_response({"outputs": y.tolist()})


def make_app() -> web.Application:
    app = web.Application()
    app.cleanup_ctx.append(devices)
    app.router.add_post("/infer", infer)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="aiohttp serving an hcqa pipeline")
    parser.add_argument("--port", type=int, default=8080)
    web.run_app(make_app(), host="127.0.0.1", port=parser.parse_args().port, **SERVER_OPTIONS)
