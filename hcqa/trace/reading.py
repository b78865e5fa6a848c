"""Reading a trace file: loading and checking it, and the view of its tracks that the
summary (:mod:`hcqa.trace.view`) and the plot (:mod:`hcqa.trace.plotting`) share; and
writing one, whole or not at all.

Theory of operation
-------------------
:func:`load` reads a Chrome Trace Event JSON file and checks every event that the readers
use (a range needs a numeric ``ts`` and ``dur``, a flow its ``id``, a name event its
``args.name``) before anything looks at it, so a damaged or foreign file gives one sentence
naming the file, the event and what is wrong (:class:`TraceFormatError`) rather than a
``KeyError`` from deep inside a reader. :func:`~hcqa.trace.view.summarize` and
:func:`~hcqa.trace.plotting.plot` run the same check on documents handed to them directly.

Tracks are ``(pid, tid)`` pairs named by the ``process_name`` / ``thread_name`` metadata; the
trio process (the one named ``"trio"``, else pid 1) holds a track per task, every other
process is a device with a track per queue.

:func:`_view` sorts a checked document into those tracks (device ranges and trio task steps),
the program's regions and a served model's requests and batches; the helpers below it (busy
time of overlapping ranges, clipping to a window, readable task labels) serve both readers.

The tracer writes its file with :func:`write_atomically` (a temp file beside it, then one
rename: a reader never sees half a trace) after :func:`check_writable` refused a path it
could never write when the tracer was made, not when the run ends and the trace is lost.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from hcqa.errors import HcqaError, InvalidCommand

__all__ = ["REGION", "TraceFormatError", "check", "load"]

Event = dict[str, Any]
Track = tuple[int, int]
REGION = "region"  # the category of a region's range (Tracer.region)
SERVE = "serve"  # the category of a served request's or batch's range (trace/serving.py)


class TraceFormatError(HcqaError, ValueError):
    """A trace file that is not (or no longer) a Chrome trace hcqa can read."""


# -- loading and checking ---------------------------------------------------------------------


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_NEEDS: dict[str, tuple[str, ...]] = {
    "X": ("pid", "tid", "ts", "dur"),
    "i": ("pid", "tid", "ts"),
    "s": ("pid", "tid", "ts", "id"),
    "f": ("pid", "tid", "ts", "id"),
}
_NUMERIC = {"ts", "dur"}


def _problem(e: object) -> str | None:
    """What is wrong with one event, or None."""
    if not isinstance(e, dict):
        return f"is a {type(e).__name__}, not an object"
    ph = e.get("ph")
    if not isinstance(ph, str):
        return f"has no 'ph' (got {ph!r})"
    if ph == "M":
        args = e.get("args")
        named = isinstance(args, dict) and isinstance(args.get("name"), str)
        if e.get("name") in ("process_name", "thread_name") and ("pid" not in e or not named):
            return "(a name event) has no 'pid' or no 'args.name' string"
        return None
    for key in _NEEDS.get(ph, ()):
        if key not in e:
            return f"(ph {ph!r}, name {e.get('name')!r}) has no {key!r}"
        if key in _NUMERIC and not _is_number(e[key]):
            return f"(ph {ph!r}, name {e.get('name')!r}) has a non-numeric {key!r} ({e[key]!r})"
    if ph == "X" and e["dur"] < 0:
        return f"(ph 'X', name {e.get('name')!r}) has a negative 'dur' ({e['dur']!r})"
    return None


def check(doc: object, source: str = "the trace") -> list[Event]:
    """The events of ``doc``; :class:`TraceFormatError` naming ``source`` if one is unusable."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        what = type(doc).__name__ if not isinstance(doc, dict) else "an object without it"
        raise TraceFormatError(
            f"{source} is not a Chrome trace: expected an object with a 'traceEvents' list "
            f"(got {what})"
        )
    events: list[Event] = doc["traceEvents"]
    for i, e in enumerate(events):
        problem = _problem(e)
        if problem is not None:
            raise TraceFormatError(f"{source} is malformed: event {i} {problem}")
    return events


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a trace file (:class:`TraceFormatError` if it is not a usable trace;
    OSError if it cannot be read)."""
    source = repr(os.fspath(path))
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(
            f"{source} is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except UnicodeDecodeError:
        raise TraceFormatError(f"{source} is not a text file (not UTF-8)") from None
    check(doc, source)
    return doc  # type: ignore[no-any-return]


# -- shared by the readers --------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _View:
    procs: dict[int, str]
    threads: dict[Track, str]
    ranges: list[Event]  # device ranges and trio task steps
    trio_pid: int
    regions: list[Event] = attrs.field(factory=list)  # cat "region": the program's phases
    serving: list[Event] = attrs.field(factory=list)  # cat "serve": requests and batches

    @property
    def device(self) -> list[Event]:
        return [e for e in self.ranges if e["pid"] != self.trio_pid]

    def device_name(self, pid: int) -> str:
        return self.procs.get(pid, f"pid {pid}")

    def track_name(self, key: Track) -> str:
        return self.threads.get(key, f"{self.device_name(key[0])} {key[1]}")

    def task_labels(self) -> dict[Track, str]:
        """Readable, distinct labels of the trio tasks, numbered in the order they started."""
        keys = sorted({(e["pid"], e["tid"]) for e in self.ranges if e["pid"] == self.trio_pid})
        return dict(zip(keys, _unique([_short(self.track_name(k)) for k in keys]), strict=True))


def _view(doc: Mapping[str, Any]) -> _View:
    events = check(doc)
    procs: dict[int, str] = {}
    threads: dict[Track, str] = {}
    for e in events:
        if e["ph"] == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "M" and e.get("name") == "thread_name":
            threads[e["pid"], e.get("tid", 0)] = e["args"]["name"]
    trio_pid = next((p for p, n in procs.items() if n == "trio"), 1)
    ranges = [e for e in events if e["ph"] == "X" and e.get("cat") not in (REGION, SERVE)]
    regions = sorted(
        (e for e in events if e["ph"] == "X" and e.get("cat") == REGION),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    serving = [e for e in events if e["ph"] == "X" and e.get("cat") == SERVE]
    return _View(
        procs=procs,
        threads=threads,
        ranges=ranges,
        trio_pid=trio_pid,
        regions=regions,
        serving=serving,
    )


def _busy(ranges: Sequence[tuple[float, float]]) -> float:
    """Total time covered by the union of (ts, dur) ranges."""
    total, end = 0.0, float("-inf")
    for ts, dur in sorted(ranges):
        total += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
    return total


def _clip(ranges: Sequence[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of (ts, dur) ranges inside [lo, hi]."""
    out = []
    for ts, dur in ranges:
        a, b = max(ts, lo), min(ts + dur, hi)
        if b > a or (dur == 0 and lo <= ts <= hi):
            out.append((a, max(b - a, 0.0)))
    return out


_LOCALS = re.compile(r"^(?P<outer>.*?)\.<locals>\.(?P<inner>[^<>]+)$")


def _short(name: str) -> str:
    """A task's name made readable: ``pkg.mod.fn.<locals>.inner`` -> ``inner (pkg.mod.fn)``."""
    m = _LOCALS.match(name)
    return f"{m['inner']} ({m['outer']})" if m else name


def _ms(us: float) -> str:
    return f"{us / 1000:.3g} ms" if us >= 1000 else f"{us:.3g} us"


def _unique(labels: Sequence[str]) -> list[str]:
    """Labels with repeats numbered (``worker #1``, ``worker #2``) so no two rows read alike."""
    total = Counter(labels)
    seen: Counter[str] = Counter()
    out = []
    for label in labels:
        seen[label] += 1
        out.append(f"{label} #{seen[label]}" if total[label] > 1 else label)
    return out


def check_writable(path: str) -> None:
    """Refuse a trace path that can't be written: its directory is missing or not
    writable, or the path is a directory. (A temp file is made and removed, the way
    :func:`write_atomically` will write it.)"""
    if os.path.isdir(path):
        raise InvalidCommand(f"Tracer: the trace path must be a file (got a directory: {path!r})")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".hcqa-trace-", suffix=".tmp")
    except OSError as exc:
        raise InvalidCommand(
            f"Tracer: can't write the trace to {path!r}: its folder {folder!r} must exist "
            f"and be writable (got {exc.strerror})"
        ) from None
    os.close(fd)
    os.unlink(tmp)


def write_atomically(target: str, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` as JSON to a fresh temp file (``mkstemp``: unpredictable name,
    ``O_EXCL``, mode 0600) beside ``target``, then ``os.replace`` it: a planted symlink
    at ``target`` is replaced, never followed, and readers never see half a file. The
    trace keeps mode 0600 (only its owner reads it)."""
    folder = os.path.dirname(os.path.abspath(target))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".hcqa-trace-", suffix=".tmp")
    except OSError as exc:
        raise OSError(exc.errno, f"hcqa.Tracer can't write the trace to {target!r}: {exc}") from exc
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OSError(
                exc.errno, f"hcqa.Tracer can't write the trace to {target!r}: {exc}"
            ) from exc
        raise
