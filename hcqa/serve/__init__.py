"""An async inference server: Starlette on trio (through anyio) under hcqa's HTTP server.

Theory of operation
-------------------
:func:`make_app` builds a Starlette app around a :class:`~hcqa.Pipeline` (or a
:class:`~hcqa.ProcessPipeline`) and, optionally, a :class:`~hcqa.Batcher` over it;
:func:`serve` opens the batcher, runs the app under :mod:`hcqa.serve.http` (a lean
HTTP/1.1 server on trio; hypercorn's trio worker on request) in the current trio run, and
drains on a shutdown trigger. The HTTP server, the batcher's collector, the pipeline's
queue actors and the devices' wake-ups share one event loop; the kernels run in engine
threads (or worker processes), so the loop only routes.

``POST /infer`` reads the body (bounded: 413 past ``max_body``), decodes it
(:mod:`hcqa.serve.inputs`: one sample or a batch, JSON or raw bytes, plain-language 400s)
and then

- one sample: ``await batcher(sample)`` -- it shares a microbatch with whatever other
  single samples are pending (without a batcher it runs alone, padded to the pipeline's
  batch dimension);
- a batch of ``n``: runs directly, in chunks of the pipeline's batch dimension (the last
  one padded), up to the pipeline's depth at once.

A client that disconnects cancels its request (see :mod:`hcqa.batcher` for what that
does to its batch). ``max_pending`` bounds the ``/infer`` requests admitted at once;
one more gets ``503`` at once instead of queueing.

Draining: when the shutdown trigger fires (``hcqa serve`` wires it to SIGTERM and
SIGINT), the HTTP server closes the listening sockets, lets requests in flight finish for up to
``grace_period`` seconds and closes idle keep-alive connections; then the batcher drains
and :func:`serve` returns.

Metrics: ``GET /metrics`` is Prometheus text from a private ``CollectorRegistry`` per app
(two apps in one process never share counters): request counts and latency histograms by
endpoint and status, and, read at scrape time, the batch-size histogram, queue depths,
batches in flight and each device's busy state.

The app's own code awaits through anyio, not trio, so it also runs under an asyncio
server (uvicorn); the pipeline and batcher it awaits are hcqa's.

Where each part lives: :mod:`hcqa.serve.app` (the routes and their errors),
:mod:`hcqa.serve.inputs` (request bodies to arrays), :mod:`hcqa.serve.metrics` (counters,
histograms and the scrape-time collector), :mod:`hcqa.serve.server` (choosing the HTTP server,
draining, the demo MLP), :mod:`hcqa.serve.http` (the HTTP/1.1 server; request heads in
:mod:`hcqa.serve.http_head`, a request's ``receive`` and ``send`` in
:mod:`hcqa.serve.http_exchange`), :mod:`hcqa.serve.v2` and :mod:`hcqa.serve.tensors` (the Open
Inference Protocol). ``import hcqa.serve`` needs starlette and prometheus-client; hypercorn is
imported only by ``serve(http="hypercorn")``.
"""

from __future__ import annotations

from hcqa.errors import install_hint

try:
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        f"hcqa.serve needs starlette and prometheus-client: {exc.name} is "
        f"missing ({install_hint('serve')})"
    ) from exc

from hcqa.serve.app import make_app
from hcqa.serve.hosted import Model
from hcqa.serve.server import mlp_pipeline, serve

__all__ = ["Model", "make_app", "mlp_pipeline", "serve"]
