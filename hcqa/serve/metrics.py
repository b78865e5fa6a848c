"""What a served app counts and exposes at ``GET /metrics``.

Theory of operation
-------------------
Each app made by :func:`hcqa.serve.make_app` owns one :class:`State`: the models it
serves (:class:`~hcqa.serve.hosted.Hosted`), the admission counter behind ``max_pending``
(:meth:`State.admit`, taken once a request's body has arrived), the body's size and time
limits, the drain flag, and a *private* Prometheus ``CollectorRegistry`` -- two apps in
one process never share a counter. Two kinds of metric live there:

- **Counted as requests pass**: :class:`Measured` is an ASGI middleware around the whole
  app that counts every HTTP request by endpoint and status and observes its latency
  (first byte in to response out). A request whose client left (status 499, or
  :class:`~hcqa.serve.bodies.ClientGone` raised by any endpoint) is counted apart, in
  ``hcqa_client_disconnects_total``: nobody saw an answer, and it is no server error.
  The middleware also counts the requests inside the app, so a drain knows when the last
  one is answered, and while draining it adds ``Connection: close`` to every response.
- **Read when scraped**: :class:`ScrapeTime` is a custom collector that reads every
  model's batcher and pipeline and the devices' ``statistics()`` only when ``/metrics`` is
  scraped, so a busy server pays nothing between scrapes for readiness, queue depths,
  batches in flight and the batch-size histogram (each labelled by ``model``) and each
  device's busy and usable state (by ``device``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hcqa.devices.base import Device
from hcqa.serve.bodies import ClientGone, InputError
from hcqa.serve.hosted import Hosted

__all__ = ["ENDPOINTS", "Measured", "ScrapeTime", "State", "endpoint_of"]

ENDPOINTS = ("/health", "/infer", "/metrics", "/stats")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


class State:
    """What the endpoints share: the served models, admission, limits and metrics."""

    def __init__(
        self,
        models: Sequence[Hosted],
        *,
        max_pending: int | None,
        max_body: int | None,
        body_timeout: float = 30.0,
    ) -> None:
        self.models = list(models)
        self.by_name = {m.name: m for m in self.models}
        self.first = self.models[0]
        self.max_pending = max_pending
        self._max_body = max_body
        self.body_timeout = body_timeout
        self._limiter: anyio.CapacityLimiter | None = None
        self.draining = False  # set when a drain starts: answers carry Connection: close
        self.active = 0  # HTTP requests inside the app now
        self._idle: anyio.Event | None = None  # set when active drops to 0
        self.started = time.monotonic()
        self.pending = 0  # inference requests admitted and not yet answered
        self.pending_by: dict[str, int] = {m.name: 0 for m in self.models}
        self.receiving = 0  # request bodies being read (not admitted yet)
        self.latencies: dict[str, list[float]] = {m.name: [] for m in self.models}
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "hcqa_requests",
            "HTTP requests answered",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "hcqa_request_duration_seconds",
            "HTTP request latency, from the first byte of the request to the response",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.disconnects = Counter(
            "hcqa_client_disconnects",
            "requests whose client left before their answer (mid-body or while waiting)",
            ["endpoint"],
            registry=self.registry,
        )
        self.registry.register(ScrapeTime(self))

    @property
    def max_body(self) -> int:
        """The largest body: as set, else 32 batches of the largest ready model, >= 1 MiB."""
        if self._max_body is not None:
            return self._max_body
        most = 0
        for m in self.models:
            t = m.target
            if t is not None:
                row = sum(math.prod(s.sample_shape) * s.dtype.itemsize for s in t.inputs)
                most = max(most, 32 * t.rows * row)
        return max(1 << 20, most)

    @property
    def devices(self) -> list[Device]:
        """Every ready model's devices, each once."""
        found: dict[int, Device] = {}
        for m in self.models:
            if m.target is not None:
                found.update((id(d), d) for d in m.target.devices)
        return list(found.values())

    @contextmanager
    def admit(self, model: Hosted) -> Iterator[None]:
        """Hold one of the ``max_pending`` admission slots; InputError 503 when none is free.
        Take it once the request's body has arrived (a slow body holds no slot)."""
        if self.max_pending is not None and self.pending >= self.max_pending:
            raise InputError(503, f"too many requests waiting (limit {self.max_pending})")
        self.pending += 1
        self.pending_by[model.name] += 1
        try:
            yield
        finally:
            self.pending -= 1
            self.pending_by[model.name] -= 1

    def record(self, model: Hosted, seconds: float) -> None:
        """A successful inference's latency (the last 4096 to 8192 are kept)."""
        lat = self.latencies[model.name]
        lat.append(seconds)
        if len(lat) > 8192:
            del lat[:4096]

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """The worker threads that decode and encode big JSON bodies: one at a time."""
        if self._limiter is None:  # made on first use, on the app's event loop
            self._limiter = anyio.CapacityLimiter(1)
        return self._limiter

    async def wait_idle(self) -> None:
        """Return once no HTTP request is inside the app."""
        while self.active:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    def device_rows(self, model: Hosted | None = None) -> list[dict[str, Any]]:
        rows = []
        if model is None:
            devices = self.devices
        else:
            devices = list(model.target.devices) if model.target is not None else []
        for d in devices:
            s = d.statistics()
            rows.append(
                {
                    "name": s.name,
                    "timeline": s.timeline_value,
                    "pending": sum(q.submitted - q.completed for q in s.queues),
                    "faulted": s.faulted,
                    "hung": s.hung,
                    "closed": s.closed,
                }
            )
        return rows


class ScrapeTime(Collector):
    """Metrics read from the batcher, pipeline and devices when ``/metrics`` is scraped."""

    def __init__(self, state: State) -> None:
        self.state = state

    def collect(self) -> Iterable[Any]:
        st = self.state
        yield GaugeMetricFamily(
            "hcqa_requests_pending",
            "inference requests admitted and not yet answered",
            value=st.pending,
        )
        yield GaugeMetricFamily(
            "hcqa_requests_receiving",
            "requests whose body is still arriving (not admitted yet)",
            value=st.receiving,
        )
        ready = GaugeMetricFamily(
            "hcqa_model_ready",
            "1 while the model is built and its devices usable",
            labels=["model"],
        )
        pending = GaugeMetricFamily(
            "hcqa_model_requests_pending", "the model's admitted requests", labels=["model"]
        )
        in_flight = GaugeMetricFamily(
            "hcqa_pipeline_in_flight", "microbatches on the model's pipeline now", labels=["model"]
        )
        depth = GaugeMetricFamily("hcqa_pipeline_depth", "microbatches allowed", labels=["model"])
        queue = GaugeMetricFamily(
            "hcqa_batcher_queue_depth", "single samples waiting for a batch", labels=["model"]
        )
        running = GaugeMetricFamily(
            "hcqa_batcher_in_flight", "batches running now", labels=["model"]
        )
        sizes = HistogramMetricFamily(
            "hcqa_batch_size", "samples per batch run by the dynamic batcher", labels=["model"]
        )
        waits = {
            q: GaugeMetricFamily(
                f"hcqa_batcher_queue_wait_{q}_seconds",
                f"queue wait, quantile 0.{q[1:]}, of the last 4096 single samples",
                labels=["model"],
            )
            for q in ("p50", "p99")
        }
        for m in st.models:
            label = [m.name]
            ready.add_metric(label, 0.0 if m.unavailable() else 1.0)
            pending.add_metric(label, st.pending_by[m.name])
            p = m.target.statistics() if m.target is not None else None
            if p is not None and hasattr(p, "in_flight"):
                in_flight.add_metric(label, p.in_flight)
                depth.add_metric(label, p.depth)
            if m.batcher is None:
                continue
            b = m.batcher.statistics()
            queue.add_metric(label, b.pending)
            running.add_metric(label, b.in_flight)
            buckets = []
            edges = sorted({2**k for k in range(b.max_batch.bit_length())} | {b.max_batch})
            for edge in edges:
                buckets.append((str(edge), sum(b.batch_sizes[:edge])))
            buckets.append(("+Inf", b.batches))
            sizes.add_metric(label, buckets, b.samples)
            for q, v in (("p50", b.queue_wait_p50), ("p99", b.queue_wait_p99)):
                waits[q].add_metric(label, 0.0 if math.isnan(v) else v)
        yield from (ready, pending, in_flight, depth, queue, running, sizes, *waits.values())
        busy = GaugeMetricFamily(
            "hcqa_device_busy", "1 while the device has work queued or running", labels=["device"]
        )
        queued = GaugeMetricFamily(
            "hcqa_device_pending_batches",
            "command batches submitted, not completed",
            labels=["device"],
        )
        healthy = GaugeMetricFamily(
            "hcqa_device_usable", "0 once the device faulted, hung or closed", labels=["device"]
        )
        for d in st.device_rows():
            busy.add_metric([d["name"]], 1.0 if d["pending"] else 0.0)
            queued.add_metric([d["name"]], d["pending"])
            healthy.add_metric([d["name"]], 0.0 if d["faulted"] or d["hung"] or d["closed"] else 1)
        yield from (busy, queued, healthy)


_V2_FIXED = (
    "/v2",
    "/v2/health/live",
    "/v2/health/ready",
    "/v2/repository/index",
    "/v2/models/stats",
)


def endpoint_of(path: str) -> str:
    """The metrics label of a request path: the route, never the model's name (so the
    number of label values stays bounded whatever clients send)."""
    path = path.rstrip("/") or "/"
    if path in ENDPOINTS or path in _V2_FIXED:
        return path
    parts = path.split("/")
    if len(parts) >= 4 and parts[:3] == ["", "v2", "models"]:
        known = ("ready", "infer", "config", "stats")
        tail = parts[-1] if parts[-1] in known and len(parts) in (5, 7) else ""
        return "/v2/models/{model}" + (f"/{tail}" if tail else "")
    return "other"


class Measured:
    """ASGI middleware: counts and times every HTTP request by endpoint and status."""

    def __init__(self, app: ASGIApp, state: State) -> None:
        self.app = app
        self.state = state
        self._counted: dict[tuple[str, int], tuple[Any, Any]] = {}  # (endpoint, status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.state
        t0 = time.perf_counter()
        endpoint = endpoint_of(scope["path"])
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if st.draining:
                    headers = [(k, v) for k, v in message["headers"] if k.lower() != b"connection"]
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        st.active += 1
        try:
            await self.app(scope, receive, send_status)
        except (ClientGone, ClientDisconnect):
            status[0] = 499
        finally:
            st.active -= 1
            if not st.active and st._idle is not None:
                st._idle.set()
                st._idle = None
            if status[0] == 499:
                st.disconnects.labels(endpoint).inc()
            else:
                counted = self._counted.get((endpoint, status[0]))
                if counted is None:  # labels() takes a lock and formats: once per pair
                    counted = self._counted[endpoint, status[0]] = (
                        st.requests.labels(endpoint, str(status[0])),
                        st.latency.labels(endpoint),
                    )
                counted[0].inc()
                counted[1].observe(time.perf_counter() - t0)
