"""Tracing: trio task steps and device work in one Chrome-trace (Perfetto) JSON file.

Theory of operation
-------------------
A :class:`Tracer` is a ``trio.abc.Instrument`` (``trio.run(main, instruments=[t])``,
``trio.lowlevel.add_instrument`` or ``with Tracer(path):`` in a run). It records raw
ns tuples on one clock (``time.monotonic_ns``, as ``Signal.timestamp``), turned into
JSON when the file is written:

* **trio tasks** (pid 1 "trio", a track per task, cat ``"trio"``): one complete event
  (``ph: "X"``) per task step, ``before_task_step`` to ``after_task_step``, and
  instants at spawn and exit. Steps run one at a time, so they never overlap.
* **device work** (a pid per device, a track per queue, cat ``"device"``): an active
  tracer is ``hcqa.actors.engine.trace_hook``, which an engine reads once per run of
  commands (the whole cost when off). When set, that run goes through the engine's
  handler table wrapped by the track's ``record``, which reads the clock right before
  and after every kernel, copy, load or native run (a fused ``RunC`` is one range,
  ``native[add1 x100]``, names and count in ``args``) and adds the event with one
  ``append``/``extend`` (atomic under the GIL). Each engine's ranges are sequential.
* **signal waits** (flows ``s``/``f``): before an engine runs ``Signal(sig, v)`` it
  maps (sig, v) to its last range. A queue actor that *awaited* a Wait asks the
  tracer (``waited``): a producer on another track becomes a pending flow of the run
  the actor hands over next, and that engine emits the ``s`` (middle of the
  producer's range) with the ``f`` (middle of its own first range of the run), so
  every ``s`` has its later ``f``. A run with no range drops its pending flows.

* **regions** (cat ``"region"``): ``with tracer.region("warm-up"):`` (or
  ``hcqa.trace.region``, which finds the tracer recording this process) is one complete
  event on a ``"regions"`` track of the trio process, from entry to exit, from any task or
  thread. They name the phases of a program (the demo marks its warm-up, the pipeline and
  the one-device run); Perfetto shows the track and ``hcqa trace plot`` shades and labels
  them. Nest them or keep them one after another: one track holds them all.

Past ``max_events`` events are dropped and counted (``otherData.dropped_events``).
``save()`` (and ``after_run``) writes the file and stops device recording; a later
trio hook of a still-installed tracer resumes it. One tracer records device work at
a time. ``summarize``/``plot`` (in ``view.py``) read a trace back (``hcqa trace
summary|plot``);
``instruments_from_env()`` is ``[Tracer($HCQA_TRACE)]`` or ``[]``, for ``trio.run``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from typing import Any

import trio

from hcqa import aio
from hcqa import commands as cmd
from hcqa.actors import engine as _engine
from hcqa.errors import InvalidCommand
from hcqa.trace import reading, serving

__all__ = ["TRIO_PID", "Tracer", "instruments_from_env", "region"]

_now = time.monotonic_ns
_BOOKKEEPING = frozenset({cmd.Signal, cmd.Timestamp, cmd.MemoryBarrier, cmd.Step, cmd.Bind})
_PRODUCED_CAP = 4096  # remembered (signal, value) -> producer range entries
_SUBMITTED_CAP = 256  # submissions from a served request or batch not yet run, per queue
_SCAN = 16  # of those, how many a run is matched against
_NO_HANDLERS: dict[type, Any] = {}  # a driver's run: nothing runs on the host
TRIO_PID = 1  # not 0: Perfetto treats pid 0 as the kernel's swapper
Span = tuple[int, int, int, int]  # pid, tid, t0 ns, t1 ns


class _Track:
    """One engine's track and state (``last``, ``pending``: touched by its thread only)."""

    __slots__ = (
        *("base", "cap", "events", "fed", "last", "pending", "pid", "submitted", "table", "tag"),
        *("tid", "tracer"),
    )

    def __init__(self, tracer: Tracer, pid: int, tid: int) -> None:
        self.tracer, self.pid, self.tid = tracer, pid, tid
        self.events, self.cap = tracer._events, tracer.max_events
        self.last: tuple[Any, ...] | None = None  # the event of the last range this engine ran
        self.pending: list[Span] | None = None  # producers of flows into the next range
        self.base: dict[type, _engine.Handler] | None = None  # the engine's handler table
        self.table: dict[type, _engine.Handler] = {}  # ... with each handler wrapped in record
        # served work (trace/serving.py): (first command, source point, tag) per submission;
        # the source of a flow into the run's first range, and the run's ranges' args
        self.submitted: collections.deque[tuple[Any, tuple[int, int, int], Any]] = (
            collections.deque()
        )
        self.fed: tuple[int, int, int] | None = None
        self.tag: dict[str, Any] | None = None

    def record(self, handler: _engine.Handler, command: Any) -> None:
        kind = type(command)
        if kind in _BOOKKEEPING:
            if kind is cmd.Signal and self.last is not None:
                self.tracer._produced_by(command.signal, command.value, self.last)
            handler(command)
            return
        t0 = _now()
        try:
            handler(command)
        except BaseException as exc:
            self.tracer._range(self, command, t0, _now(), type(exc).__name__)
            raise
        t1 = _now()
        if self.pending is None and kind is cmd.Exec and not command.vals:  # the common case
            name = command.program.name
            self.last = ev = ("X", self.pid, self.tid, t0, t1 - t0, name, "device", self.tag)
            if len(self.events) < self.cap:
                self.events.append(ev)
            else:
                self.tracer.dropped += 1
        else:
            self.tracer._range(self, command, t0, t1, None)


class Tracer(trio.abc.Instrument):
    """Records trio task steps and device ranges; writes Chrome Trace Event JSON to ``path``."""

    def __init__(self, path: str | os.PathLike[str], *, max_events: int = 500_000) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidCommand(f"'path' must be a str or os.PathLike (got {type(path).__name__})")
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 0:
            raise InvalidCommand(f"'max_events' must be an int >= 0 (got {max_events!r})")
        self.path = os.fspath(path)
        reading.check_writable(self.path)  # now, not when the run ends and the trace is lost
        self.max_events = max_events
        self.dropped = 0
        self._origin = _now()
        self._events: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._on = False
        self._tids = itertools.count(1)
        self._flow_ids = itertools.count(1)
        self._pids: dict[str, int] = {}
        self._threads: list[tuple[int, int, str]] = []
        self._engines: dict[Any, _Track] = {}
        self._produced: dict[tuple[Any, int], Span] = {}
        self._flows: dict[int, tuple[list[Any], list[Span]]] = {}
        self._native: dict[tuple[str, ...], tuple[str, dict[str, Any]]] = {}
        self._tasks: dict[trio.lowlevel.Task, tuple[int, str]] = {}
        self._step_t0 = 0
        self._exiting: trio.lowlevel.Task | None = None
        self._regions_tid = 0  # the "regions" track, made on the first region
        self._renamed: dict[tuple[int, int], str] = {}  # tracks named anew (a served task)
        self.server = serving.ServerTracks(self, TRIO_PID)  # requests and batches

    def start(self) -> None:
        """Start recording device activity (called by the trio hooks)."""
        if self._on:
            return
        self._on = True
        if _engine.trace_hook is None:
            _engine.trace_hook = self
        elif _engine.trace_hook is not self:
            msg = "another hcqa.Tracer is recording device activity; this one records trio only"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def stop(self) -> None:
        """Stop recording device activity (``save`` does this)."""
        self._on = False
        if _engine.trace_hook is self:
            _engine.trace_hook = None

    def __enter__(self) -> Tracer:
        trio.lowlevel.add_instrument(self)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(KeyError):  # trio removed it already (a hook raised)
            trio.lowlevel.remove_instrument(self)
        self.save()

    def before_run(self) -> None:
        self.start()

    def after_run(self) -> None:
        try:
            self.save()
        except OSError as exc:  # trio would only log it: say it where the user looks
            warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
            raise

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self._instant(task, "spawned")

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._instant(task, "exited")
        self.server.task_exited(task)
        self._exiting = task  # trio calls after_task_step for its last step after this

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if not self._on:
            self.start()
        self._step_t0 = _now()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        t0, t1 = self._step_t0, _now()
        self._step_t0 = 0
        if t0 and self._room(1):  # (every step of a busy server: kept to one lookup)
            tid, label = self._tasks.get(task) or self._task(task)
            self._events.append(("X", TRIO_PID, tid, t0, t1 - t0, label, "trio", None))
        if self._exiting is task:
            self._exiting = None
            self._tasks.pop(task, None)

    def region(self, name: str, **args: Any) -> contextlib.AbstractContextManager[None]:
        """Record the ``with`` block as a range called ``name`` (``args`` go into the event) on
        the trace's ``"regions"`` track: a phase of the program, which Perfetto shows and
        ``hcqa trace plot`` shades and labels. Usable from any task or thread."""
        _check_region(name)
        return self._region(name, args)

    @contextlib.contextmanager
    def _region(self, name: str, args: dict[str, Any]) -> Iterator[None]:
        t0 = _now()
        try:
            yield
        finally:
            t1 = _now()
            if self._room(1):
                tid = self._regions_tid or self._regions_track()
                self._events.append(("X", TRIO_PID, tid, t0, t1 - t0, name, "region", args))

    def _regions_track(self) -> int:
        with self._lock:
            if not self._regions_tid:
                self._regions_tid = next(self._tids)
                self._threads.append((TRIO_PID, self._regions_tid, "regions"))
            return self._regions_tid

    def _instant(self, task: trio.lowlevel.Task, what: str) -> None:
        if self._room(1):
            tid, _ = self._task(task)
            self._events.append(("i", TRIO_PID, tid, _now(), 0, what, "trio", None))

    def _task(self, task: trio.lowlevel.Task) -> tuple[int, str]:
        entry = self._tasks.get(task)
        if entry is None:
            entry = self._tasks[task] = (next(self._tids), _task_label(task))
            self._threads.append((TRIO_PID, *entry))
        return entry

    def _new_track(self, pid: int, name: str) -> int:
        """A new track called ``name`` in process ``pid``; its tid."""
        with self._lock:
            tid = next(self._tids)
            self._threads.append((pid, tid, name))
            return tid

    def _rename(self, task: trio.lowlevel.Task, label: str) -> None:
        """Call ``task``'s track ``label`` from now on (and in the file)."""
        tid, _ = self._task(task)
        self._tasks[task] = (tid, label)
        self._renamed[TRIO_PID, tid] = label

    def _add(self, events: list[tuple[Any, ...]]) -> None:
        if self._room(len(events)):
            self._events.extend(events)

    def _flow_id(self) -> int:
        return next(self._flow_ids)

    def _room(self, n: int) -> bool:
        if len(self._events) + n <= self.max_events:
            return True
        self.dropped += n  # approximate when several threads race: a counter, not a ledger
        return False

    def engine_run(self, engine: Any, run: list[Any], table: dict[type, _engine.Handler]) -> Any:
        """Called by an engine thread before each run: its handler table, wrapped to record."""
        track = self._engines.get(engine) or self._track(engine)
        entry = None
        if self._flows:
            with self._lock:
                entry = self._flows.pop(id(run), None)
        track.pending = entry[1] if entry is not None and entry[0] is run else None
        track.fed = track.tag = None
        if track.submitted:
            self._served_run(track, run)
        if track.base is not table:
            track.base, track.table = table, {k: partial(track.record, h) for k, h in table.items()}
        return track.table

    def _driver_run(self, engine: Any, run: list[Any]) -> tuple[Any, Any]:
        """A driver's executor (OpenCL, CUDA) enqueues ``run`` now and draws its ranges
        later, at completion, on another thread: what :meth:`engine_run` noted for it is taken
        off the track and handed back to travel with the run's segments -- the flows into its
        first range, and ``(fed, tag)`` when a served request or batch submitted it."""
        track = self._engines.get(engine) or self._track(engine)
        self.engine_run(engine, run, _NO_HANDLERS)
        flows, fed, tag = track.pending, track.fed, track.tag
        track.pending = track.fed = track.tag = None
        return flows, (fed, tag) if fed is not None or tag is not None else None

    def _driver_ranges(
        self, engine: Any, flows: Any, served: Any, ranges: Iterable[tuple[Any, int, int]]
    ) -> _Track:
        """A driver's segment completed: its ``ranges`` (command, start, end on the host
        clock), the ``flows`` into the first, ``served`` (from :meth:`_driver_run`) drawn."""
        track = self._engines.get(engine) or self._track(engine)
        if flows:
            track.pending = flows
        if served is not None:
            track.fed, track.tag = served
        for command, t0, t1 in ranges:
            self._range(track, command, t0, t1, None)
        track.fed = track.tag = None
        return track

    def sent(self, engine: Any, commands: list[Any]) -> None:
        """A queue actor was handed ``commands``: from a served request or batch, note it."""
        src = serving.source.get()
        if src is None:
            return
        marker = next((c for c in commands if type(c) is not cmd.Wait), None)
        if marker is None:
            return
        track = self._engines.get(engine) or self._track(engine)
        with self._lock:
            q = track.submitted
            q.append((marker, (src.pid, src.tid, _now()), src.tag))
            if len(q) > _SUBMITTED_CAP:
                q.popleft()

    def _served_run(self, track: _Track, run: Any) -> None:
        """``run`` holds a served submission's first command: its source and tag."""
        if type(run) is not list:
            return
        with self._lock:
            q = track.submitted
            for i, (marker, fed, tag) in enumerate(itertools.islice(q, _SCAN)):
                if any(c is marker for c in run):
                    for _ in range(i + 1):  # earlier ones never ran (a fault dropped them)
                        q.popleft()
                    track.fed, track.tag = fed, tag
                    if track.pending is None:
                        track.pending = []  # off the fast path: _range draws the flow
                    return

    def waited(self, engine: Any, signal: Any, value: int, run: list[Any]) -> None:
        """A queue actor awaited ``signal >= value``; its next commands go to ``run``."""
        src = self._produced.get((signal, value))  # a dict read: atomic under the GIL
        if src is None:
            return
        track = self._engines.get(engine) or self._track(engine)
        if (src[0], src[1]) == (track.pid, track.tid):
            return  # same queue: no arrow
        with self._lock:  # keeping `run` referenced keeps its id unique until the engine pops it
            self._flows.setdefault(id(run), (run, []))[1].append(src)

    def _track(self, engine: Any) -> _Track:
        with self._lock:
            track = self._engines.get(engine)
            if track is not None:
                return track
            name: str = engine.name
            device = name.rpartition(" ")[0] or name
            pid = self._pids.setdefault(device, len(self._pids) + TRIO_PID + 1)
            track = self._engines[engine] = _Track(self, pid, next(self._tids))
            self._threads.append((pid, track.tid, name))  # a device opened again: a new track
            return track

    def _produced_by(self, signal: Any, value: int, ev: tuple[Any, ...]) -> None:
        with self._lock:  # (signal, value) -> the producer's range (pid, tid, t0, t1)
            produced = self._produced
            produced[(signal, value)] = (ev[1], ev[2], ev[3], ev[3] + ev[4])
            if len(produced) > _PRODUCED_CAP:
                del produced[next(iter(produced))]

    def _range(self, track: _Track, command: Any, t0: int, t1: int, error: str | None) -> None:
        name, args = self._describe(command)
        if error is not None:
            args = {**(args or {}), "error": error}
        if track.tag is not None:
            args = {**track.tag, **(args or {})}
        track.last = ev = ("X", track.pid, track.tid, t0, t1 - t0, name, "device", args)
        new: list[tuple[Any, ...]] = [ev]
        for src in track.pending or ():
            fid = next(self._flow_ids)
            new.append(("s", src[0], src[1], (src[2] + src[3]) // 2, fid, "wait", "device", None))
            new.append(("f", track.pid, track.tid, (t0 + t1) // 2, fid, "wait", "device", None))
        fed = track.fed
        if fed is not None:  # a served request or batch submitted this run
            fid = next(self._flow_ids)
            new.append(("s", fed[0], fed[1], fed[2], fid, "submit", serving.SERVE, None))
            new.append(("f", track.pid, track.tid, (t0 + t1) // 2, fid, "submit", "serve", None))
            track.fed = None
        track.pending = None
        if self._room(len(new)):
            self._events.extend(new)

    def _describe(self, c: Any) -> tuple[str, dict[str, Any] | None]:
        kind = type(c)
        if kind is cmd.Exec:
            return c.program.name, ({"vals": list(c.vals)} if c.vals else None)
        if kind is cmd.Copy:
            src, dest = getattr(c.src, "device", None), getattr(c.dest, "device", None)
            if src is not None and dest is not None and src is not dest:
                return "transfer", {"bytes": c.nbytes, "src": src.name, "dest": dest.name}
            what = "copyin" if src is None else "copyout" if dest is None else "copy"
            return "copy", {"bytes": c.nbytes, "kind": what}
        if kind is cmd.Load:
            return "load", {"bytes": c.nbytes, "path": c.path}
        names = getattr(c, "names", None)
        if isinstance(names, tuple):  # a fused run (devices/fusion.py; on cpu, crunner.RunC)
            known = self._native.get(names)
            if known is None:
                counts = {n: names.count(n) for n in dict.fromkeys(names)}
                label = f"native[{'+'.join(counts)} x{len(names)}]"
                known = self._native[names] = (label, {"kernels": len(names), "names": counts})
            return known
        return kind.__name__, None

    def save(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write the trace now (to ``path`` or the tracer's path); returns the path."""
        self.stop()
        events = self._events[:]  # one atomic snapshot; tracks only grow, so read them after
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
            for pid, name in [(TRIO_PID, "trio"), *((p, n) for n, p in list(self._pids.items()))]
        ]
        out += [
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            for pid, tid, name in list(self._threads)
        ]
        for m in out:  # a track named anew keeps its one name event, with its last name
            if m["name"] == "thread_name" and (m["pid"], m["tid"]) in self._renamed:
                m["args"] = {"name": self._renamed[m["pid"], m["tid"]]}
        origin = self._origin
        extra = {"X": "dur", "i": "s", "s": "id", "f": "id"}
        for ph, pid, tid, t, x, name, cat, args in events:
            e = {"ph": ph, "name": name, "cat": cat, "pid": pid, "tid": tid}
            e["ts"] = (t - origin) / 1000
            e[extra[ph]] = x / 1000 if ph == "X" else "t" if ph == "i" else x
            if ph == "f":
                e["bp"] = "e"  # bind to the enclosing range, like the "s"
            if args:
                e["args"] = args
            out.append(e)
        other = {"clock": "CLOCK_MONOTONIC", "origin_ns": origin, "dropped_events": self.dropped}
        doc = {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}
        target = os.fspath(path) if path is not None else self.path
        reading.write_atomically(target, doc)
        return target


def _task_label(task: trio.lowlevel.Task) -> str:
    """The task's name; a queue actor's task is named after its queue."""
    if task.name.endswith("QueueActor.run"):
        frame = getattr(task.coro, "cr_frame", None)
        actor = frame.f_locals.get("self") if frame is not None else None
        if actor is not None:
            return f"{actor.name} actor"
    return task.name


def _check_region(name: object) -> None:
    if not isinstance(name, str) or not name.strip():
        raise InvalidCommand(f"a region's 'name' must be a non-empty str (got {name!r})")


def region(name: str, **args: Any) -> contextlib.AbstractContextManager[None]:
    """``with hcqa.trace.region("warm-up"):`` records the block as a named range in the tracer
    that records this process's device work (see :meth:`Tracer.region`); with no tracer
    recording, it records nothing and costs next to nothing."""
    tracer = _engine.trace_hook
    if isinstance(tracer, Tracer):
        return tracer.region(name, **args)
    _check_region(name)
    return contextlib.nullcontext()


def instruments_from_env(environ: Mapping[str, str] | None = None) -> list[trio.abc.Instrument]:
    """``[Tracer($HCQA_TRACE)]`` when HCQA_TRACE names a file, else ``[]`` (for ``trio.run``)."""
    path = (os.environ if environ is None else environ).get("HCQA_TRACE", "").strip()
    return [Tracer(path)] if path else []


aio.default_instruments = instruments_from_env  # asyncio hosts trace per $HCQA_TRACE too
