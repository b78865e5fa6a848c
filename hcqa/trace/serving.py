"""A served model on the trace: each request and each batch a range, linked to the kernels.

Theory of operation
-------------------
The server and the batcher tell the tracer what they do through this module's functions,
each a no-op behind one ``is None`` test when no tracer records (:func:`active`):

* a **request** (:func:`request`, around an ``/infer`` endpoint's handler) is a range on a
  *lane* of the trio process named by its endpoint (``POST /v2/models/mlp/infer #3``): the
  lowest lane free when it began, so concurrent requests never overlap on one track and a
  quiet server uses one. The task that handles it (a connection's handler, which trio
  names ``_run_handler``) is renamed after the endpoints it served (``http POST ...``).
* a **batch** (:func:`batch_begin` / :func:`batch_end`, the batcher's batch task) is a
  range on a lane named ``model M batches``; a flow arrow (cat ``"serve"``) goes from each
  of its requests (where the request entered the batcher: :func:`here`) to the batch.
* the **kernels**: while a request or batch range is open in a task, the range is that
  task's *source* (a context variable). A queue actor hands every submission to
  ``Tracer.sent``, which notes the source and the submission's first command for the
  queue's engine; when that command's run reaches the engine, its first range gets a flow
  from the source, and every range of that run carries the batch's ``args`` (``batch``:
  its number, ``model``). So request -> batch -> kernels is two arrows and one tag.

These ranges have cat ``"serve"``: the readers (:mod:`hcqa.trace.reading`) keep them apart
from device ranges and trio task steps, and ``hcqa trace plot`` draws them in rows of their
own with the arrows of a few chosen batches.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import time
from collections.abc import Iterator
from typing import Any

import attrs
import trio

from hcqa.actors import engine as _engine

__all__ = ["SERVE", "ServerTracks", "active", "batch_begin", "batch_end", "here", "request"]

SERVE = "serve"  # the category of request and batch ranges, and of their flows
_now = time.monotonic_ns


@attrs.define(eq=False)
class Source:
    """An open range whose task submits work: its lane, when it began, its kernels' tag."""

    pid: int
    tid: int
    group: str
    t0: int
    tag: dict[str, Any] | None = None


# the open request or batch range of the running task (None: work not traced to one)
source: contextvars.ContextVar[Source | None] = contextvars.ContextVar(
    "hcqa_trace_source", default=None
)


def active() -> Any:
    """The tracer recording this process's device work that has server tracks, or None."""
    hook = _engine.trace_hook
    return hook if hook is not None and hasattr(hook, "server") else None


class ServerTracks:
    """A tracer's request and batch lanes (see the module doc); used on the trio thread."""

    def __init__(self, tracer: Any, pid: int) -> None:
        self.tracer, self.pid = tracer, pid
        self._free: dict[str, list[int]] = {}  # a group's free lanes (tids), lowest last
        self._made: dict[str, int] = {}  # lanes made per group
        self._batches = itertools.count(1)
        self._served: dict[trio.lowlevel.Task, list[str]] = {}

    def open(self, group: str, tag: dict[str, Any] | None = None) -> Source:
        free = self._free.setdefault(group, [])
        if free:
            tid = free.pop()
        else:
            k = self._made[group] = self._made.get(group, 0) + 1
            tid = self.tracer._new_track(self.pid, f"{group} #{k}")
        return Source(self.pid, tid, group, _now(), tag)

    def close(self, src: Source, name: str, args: dict[str, Any], flows: list[Any]) -> int:
        """Record ``src``'s range and ``flows`` (events); free its lane. Returns its end."""
        t1 = _now()
        ev = ("X", src.pid, src.tid, src.t0, t1 - src.t0, name, SERVE, args)
        self.tracer._add([ev, *flows])
        free = self._free[src.group]
        free.append(src.tid)
        free.sort(reverse=True)  # the lowest lane is taken next
        return t1

    def served(self, endpoint: str) -> None:
        """Name the running task's track after the endpoints it served."""
        task = trio.lowlevel.current_task()
        seen = self._served.setdefault(task, [])
        if endpoint in seen:
            return
        seen.append(endpoint)
        more = " +more" if len(seen) > 2 else ""
        self.tracer._rename(task, f"http {', '.join(seen[:2])}{more}")

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._served.pop(task, None)

    def batch_number(self) -> int:
        return next(self._batches)


@contextlib.contextmanager
def request(tracer: Any, endpoint: str, model: str) -> Iterator[dict[str, Any]]:
    """The block as one request's range on a lane of ``endpoint``; the caller may add to
    the dict it yields (``status``). ``tracer``: :func:`active`'s, not None."""
    tracks: ServerTracks = tracer.server
    tracks.served(endpoint)
    src = tracks.open(endpoint)
    token = source.set(src)
    args: dict[str, Any] = {"endpoint": endpoint, "model": model}
    try:
        yield args
    finally:
        source.reset(token)
        tracks.close(src, f"{model} request", args, [])


def here() -> tuple[int, int, int] | None:
    """Where the running task's open range is now (pid, tid, ns), for a flow out of it."""
    src = source.get()
    return None if src is None else (src.pid, src.tid, _now())


def batch_begin(tracer: Any, model: str) -> Source:
    """Open a batch's range (its task's source from now on: its submissions are tagged)."""
    tracks: ServerTracks = tracer.server
    number = tracks.batch_number()
    src = tracks.open(f"model {model} batches", {"batch": number, "model": model})
    source.set(src)
    return src


def batch_end(
    tracer: Any, src: Source, model: str, froms: list[tuple[int, int, int] | None], error: str
) -> None:
    """Close a batch's range: ``froms`` are its requests' :func:`here` points, each the
    start of an arrow into the batch."""
    tag = src.tag or {}
    args: dict[str, Any] = {**tag, "requests": len(froms)}
    if error:
        args["error"] = error
    flows: list[Any] = []
    t1 = _now()
    mid = (src.t0 + t1) // 2
    for f in froms:
        if f is not None:
            fid = tracer._flow_id()
            flows.append(("s", f[0], f[1], f[2], fid, "request", SERVE, None))
            flows.append(("f", src.pid, src.tid, mid, fid, "request", SERVE, None))
    source.set(None)
    tracer.server.close(src, f"{model} batch x{len(froms)}", args, flows)
