"""An async inference server: Starlette on trio (through anyio) under hcqa's HTTP server.

Theory of operation
-------------------
:func:`serve` serves one or more models: a :class:`hcqa.models.Model` (a captured graph,
its own tensor names, shapes and batch sizes), a :class:`~hcqa.Pipeline` or
:class:`~hcqa.ProcessPipeline` (one tensor ``input``, one ``output``), or any async batch
callable (its tensors declared), each under a name as a :class:`Model` -- which may instead
give a ``build``, an async context manager that opens the devices and yields the model, so
the server can build it in the background and build it again after a device fault
(:mod:`hcqa.serve.targets` turns each into one shape of batch target;
:mod:`hcqa.serve.hosted` keeps each model's life). The HTTP server starts at once and the
health endpoints answer while models build; a model is ready once built and warmed up. The
HTTP server, the batchers' collectors, the pipelines' queue actors and the devices'
wake-ups share one event loop; the kernels run in engine threads (or worker processes), so
the loop only routes.

``POST /infer`` (the first model, if it has one input and one output) and
``POST /v2/models/{m}/infer`` (the Open Inference Protocol, any model) read the body
(bounded: 413 past ``max_body``), decode it (plain-language 400s) and then

- one sample: ``await batcher(sample)`` -- it shares a microbatch with whatever other
  single samples are pending (without a batcher it runs alone);
- a batch of ``n``: runs directly, in chunks of the model's largest batch, up to its
  depth at once.

One bad request does not take the server down: a batch that raised gives its requests the
error, or retries each once alone when it held several; a faulted device is reopened and
its model rebuilt (from ``build``) while readiness is down; a model's ``check`` refuses bad
input before it is batched. A client that disconnects cancels its request (see
:mod:`hcqa.batcher` for what that does to its batch). ``max_pending`` bounds the inference
requests admitted at once; one more gets ``503`` at once instead of queueing.

Draining: when the shutdown trigger fires (by default SIGTERM or SIGINT), the HTTP server
closes the listening sockets, lets requests in flight finish for up to ``grace_period``
seconds and closes idle keep-alive connections; then the batchers drain and :func:`serve`
returns.

Metrics: ``GET /metrics`` is Prometheus text from a private ``CollectorRegistry`` per app
(two apps in one process never share counters): request counts and latency histograms by
endpoint and status, and, read at scrape time, each model's readiness, batch-size
histogram, queue depths and batches in flight (labelled by model) and each device's busy
state.

The app's own code awaits through anyio, not trio, so it also runs under an asyncio
server (uvicorn); the pipeline and batcher it awaits are hcqa's.

Where each part lives: :mod:`hcqa.serve.app` (the routes and their errors),
:mod:`hcqa.serve.targets` (what can be served), :mod:`hcqa.serve.hosted` (a model's build,
readiness, runs and recovery),
:mod:`hcqa.serve.inputs` (request bodies to arrays), :mod:`hcqa.serve.metrics` (counters,
histograms and the scrape-time collector), :mod:`hcqa.serve.server` (choosing the HTTP server,
draining, the demo MLP), :mod:`hcqa.serve.http` (the HTTP/1.1 server; request heads in
:mod:`hcqa.serve.http_head`, a request's ``receive`` and ``send`` in
:mod:`hcqa.serve.http_exchange`), :mod:`hcqa.serve.v2` and :mod:`hcqa.serve.tensors` (the Open
Inference Protocol). ``import hcqa.serve`` needs starlette, prometheus-client and httptools;
hypercorn is imported only by ``serve(http="hypercorn")``.
"""

from __future__ import annotations

from hcqa.errors import install_hint

try:
    import httptools  # noqa: F401
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        f"hcqa.serve needs starlette, prometheus-client and httptools: {exc.name} is "
        f"missing ({install_hint('serve')})"
    ) from exc

from hcqa.serve.app import make_app
from hcqa.serve.hosted import Model
from hcqa.serve.server import mlp_pipeline, serve

__all__ = ["Model", "make_app", "mlp_pipeline", "serve"]
