"""The native engine lane: a queue's commands run by a thread of C, handing over to Python.

Theory of operation
-------------------
A :class:`LaneEngine` is an :class:`~hcqa.actors.engine.Engine` (same interface, same
Python thread for what needs Python) plus a *lane*: a ring of records and a pthread that
runs them without the GIL (``hcqa/_native/lane.py``). ``put(run)`` encodes the run's
longest prefix of commands that need no Python into records -- a C kernel's call (the
device's encoder), a copy, a ``Signal`` (value, then the eventfd when a listed waiter's
target is reached), a ``Timestamp``, a timeline ``Step``, a ``MemoryBarrier`` -- and the
rest of the run, from the first command that needs Python, becomes one ``PY`` record
whose commands go to the Python thread. The lane thread runs records in order; at a
``PY`` record it gives the Python thread its turn and sleeps until that run is done, so
queue order holds across both. A Python run pushed while the lane has nothing left to
run gets its turn at once: the lane thread is not woken at all. The lane completes
timeline steps in C and writes eventfds itself; the event loop is woken exactly as by
the Python engine.

What the lane refuses goes to Python in order: Python kernels, file loads, staged
copies, signals with peers in other processes or attached from another process, every
run while a tracer records (the tracer wraps the Python handlers; the lane has none).

Encoding is cached on the command (``command.native``: the record, the signal whose
closing would make it invalid, what its addresses point into; or "needs Python"), so a
built ``Queue`` submitted again costs an attribute read per command. Records hold addresses: the
commands stay referenced by ``_pending`` until the lane's done counter passes them
(checked at the next ``put`` and at the end), and a signal a lane was handed that is
closed meanwhile releases its slot and eventfd only once every lane has run past what
it held at the close (``hcqa._native.lane.defer``).

Faults: the lane itself can't fault (a kernel can't raise in C; a copy's bounds were
checked at enqueue). When the device's error is set (a Python command raised, a Wait
broke, cancellation) the lane is told to stop at the next record boundary, and the
Python thread -- after the lane thread exited -- skips every record it did not run the
way the Python engine skips (``Signal``: break; another device's ``Step``: complete).
Closing stops the lane once everything queued has run; the Python thread waits for the
lane thread to exit (GIL released), and ``join`` joins and frees it. A lane stuck in a
kernel keeps the Python thread waiting too, so the queue is declared hung exactly like a
stuck Python engine.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Callable
from typing import Any

from hcqa import commands as cmd
from hcqa._native import lane as _lanes
from hcqa._native.lane import OP_NOP, OP_PY, OP_SIGNAL, OP_STAMP, OP_STEP, REC
from hcqa.actors import engine as _engine
from hcqa.actors.engine import Engine, Handler

__all__ = ["PYTHON", "Encoder", "LaneEngine"]

# An encoder turns one command into (record, the signal it writes or None, what the
# record's addresses point into); None: the command needs Python.
Native = tuple[bytes, Any, Any]
Encoder = Callable[[Any], Native | None]

_STOPPED = object()  # inbox marker: the lane was told to stop; skip what it left
# ``command.native`` of a command an encoder refused: it needs Python (Python can run
# every command, so a command that might later encode -- a signal that lost its peers --
# only stays on the slower path). A resubmitted Python kernel costs no encoder call.
_PYTHON: Any = ()
# Given as a new command's ``native``, it sends the command (and the rest of its run) to
# the Python thread: a copy ahead of a Python kernel runs there with it, instead of on the
# lane's thread, which would then hand over to Python (two thread wake-ups, not one).
PYTHON: Any = _PYTHON
_SIGNAL, _STAMP, _STEP = cmd.Signal, cmd.Timestamp, cmd.Step
_pack = REC.pack
_NOP = _pack(OP_NOP, 0, 0, 0, 0)


class LaneEngine(Engine):
    """An engine whose native commands run on a C thread (see the module doc)."""

    def __init__(
        self,
        name: str,
        handlers: dict[type, Handler],
        *,
        on_fault: Callable[[Any, BaseException], None],
        native: bool = False,
        encoders: dict[type, Encoder],
        lib: _lanes.Native,
    ) -> None:
        self._error: BaseException | None = None
        self._lane: int | None = None
        self._stop_sent = False
        super().__init__(name, handlers, on_fault=on_fault, native=native)
        self._lib = lib
        lane = lib.lane_new()
        if not lane:
            self.join(0)  # (never started: closes the bell)
            self.exited.close()
            raise OSError(
                f"{name}: could not make a native lane (no memory or no file descriptor left)"
            )
        self._lane = lane
        self._done = ctypes.c_uint64.from_address(lib.lane_done_addr(lane))
        self._tail = ctypes.c_uint64.from_address(lib.lane_tail_addr(lane))
        self._py_last = ctypes.c_int64.from_address(lib.lane_py_last_addr(lane))
        _lanes.register(lane, self)
        self._first = ctypes.c_uint64()
        self._first_ref = ctypes.byref(self._first)
        self._encoders: dict[type, Encoder] = {
            cmd.Signal: _signal,
            cmd.Timestamp: _stamp,
            cmd.MemoryBarrier: _barrier,
            cmd.Step: _step,
            **encoders,
        }
        # (index of the first record, the commands, the records)
        self._pending: collections.deque[tuple[int, list[Any], bytes]] = collections.deque()
        self._inbox: collections.deque[Any] = collections.deque()  # (k, run), None, _STOPPED
        self._stock = dict(self._table)  # the handlers as built: the lane does their work
        self._py = 0  # the last PY record's number
        self._lane_ok = True  # False once the lane stopped taking records
        self._plock = threading.Lock()  # put's push vs the Python thread's skipping
        self.native_runs = 0  # runs (or their prefixes) the lane ran without Python

    # -- the sticky error stops the lane -------------------------------------------------

    @property
    def error(self) -> BaseException | None:
        return self._error

    @error.setter
    def error(self, exc: BaseException | None) -> None:
        self._error = exc
        if exc is not None and self._lane is not None and not self._stop_sent:
            self._stop_sent = True
            self._lib.lane_fail(self._lane)
            self._inbox.append(_STOPPED)  # the Python thread skips what the lane left
            self._sleeping = False
            self._ring()

    # -- the caller's side -----------------------------------------------------------------

    def start(self) -> None:
        assert self._lane is not None
        if self._lib.lane_start(self._lane) != 0:
            raise RuntimeError(f"{self.name}: the native lane's thread could not start")
        super().start()

    def put(self, run: Any) -> None:
        if run is None or self._error is not None or self._dead or not self._lane_ok:
            self._put_python(0, run)
            return
        recs: list[bytes] = []
        # A tracer wraps the Python handlers, and so does hcqa.testing's fault injection:
        # then all goes to Python (so does anything that is not a list of commands).
        if _engine.trace_hook is None and type(run) is list and self._table == self._stock:
            encoders = self._encoders
            for c in run:
                nat = getattr(c, "native", None)  # (an object of another kind: Python)
                if nat is None:
                    enc = encoders.get(type(c))
                    nat = None if enc is None else enc(c)
                    if nat is None:
                        if type(c) is not _STEP:
                            object.__setattr__(c, "native", _PYTHON)
                        break
                    if nat[1] is not None:  # this lane may write the signal's slot
                        nat[1]._lanes.add(self._lane)
                    if type(c) is not _STEP:  # a step is made per submit: never reused
                        object.__setattr__(c, "native", nat)
                elif nat is _PYTHON:
                    break
                elif nat[1] is not None and nat[1]._closed:
                    break  # a closed signal: Python's write is a no-op, keep it so
                recs.append(nat[0])
        n = len(recs)
        k = 0
        if not recs and self._done.value == self._tail.value:
            # A Python run and an idle lane: it runs at once, with no call into the lane
            # (later native records wait for it: see hcqa_lane_push). -k: no turn to take.
            self._py += 1
            self._py_last.value = self._py
            self._put_python(-self._py, run)
            return
        if not recs or n < len(run):
            self._py += 1
            k = self._py
            recs.append(_pack(OP_PY, k, 0, 0, 0))
        blob = b"".join(recs)
        with self._plock:
            ok = self._lane_ok and self._error is None
            if ok:
                assert self._lane is not None
                ok = self._lib.lane_push(self._lane, blob, len(recs), self._first_ref) == 0
            if ok and n:
                self._pending.append((self._first.value, run if n == len(run) else run[:n], blob))
                self.native_runs += 1
        if not ok:  # the lane stopped meanwhile: Python skips the whole run
            for j, c in enumerate(run[:n]):  # their foreign steps are Python's again
                if type(c) is _STEP and REC.unpack_from(blob, j * REC.size)[3]:
                    c.timeline.give_back_foreign(c.seq)
            self._put_python(0, run)
            return
        if k:
            self._put_python(k, run if n == 0 else run[n:])
        self._reclaim()

    def _put_python(self, k: int, run: Any) -> None:
        self._inbox.append(run if run is None else (k, run))
        if self._sleeping:
            self._sleeping = False
            self._ring()
        if self._dead:
            self._drain_dead()

    def _reclaim(self) -> None:
        """Drop what the lane is done with (commands, their argument tables), and release
        closed signals no lane can write any more."""
        done = self._done.value
        pending = self._pending
        while pending and pending[0][0] + len(pending[0][1]) <= done:
            pending.popleft()
        _lanes.sweep()

    def tail(self) -> int:
        """How many records were pushed (the lane's next index)."""
        lane = self._lane
        return 0 if lane is None else int(self._lib.lane_tail(lane))

    def done(self) -> int:
        """How many records the lane has run (or passed)."""
        return int(self._done.value)

    def _drain_dead(self) -> None:
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            if item is None or item is _STOPPED:
                continue
            for command in item[1]:
                self._skip(command, self.error)

    def join(self, timeout: float | None = None) -> bool:
        if not super().join(timeout):
            return False
        lane, self._lane = self._lane, None
        if lane is not None:
            _lanes.unregister(lane)
            self._lib.lane_free(lane)  # joins the lane's (exited) thread
        return True

    # -- the Python thread -----------------------------------------------------------------

    def _main(self) -> None:
        handlers = self._table
        died: BaseException | None = None
        lib, lane = self._lib, self._lane
        try:
            while (item := self._next()) is not None:
                if item is _STOPPED:
                    self._skip_lane()
                    continue
                k, run = item
                if k < 0:  # handed out while the lane was idle: its turn already
                    k = -k
                elif k and lib.lane_try_turn(lane, k) == 0:
                    lib.lane_wait_turn(lane, k)  # GIL released while the lane runs
                hook = _engine.trace_hook
                table = handlers if hook is None else hook.engine_run(self, run, handlers)
                self._execute(run, table)  # (if this raises, the fault stops the lane)
                if k:
                    lib.lane_py_done(lane, k)
                del run, item
        except BaseException as exc:
            died = exc
            raise
        finally:
            if died is not None:
                self._died(died)
            self._skip_lane()  # waits for the lane thread to exit
            self.exited._set_from_engine(1)

    def _skip_lane(self) -> None:
        """Stop the lane (after what it has, or at once if failed), wait for its thread to
        exit, and skip whatever it did not run."""
        with self._plock:
            self._lane_ok = False
        assert self._lane is not None
        at = self._lib.lane_finish(self._lane)  # GIL released while it finishes
        pending = self._pending
        error = self.error
        while pending:
            first, commands, blob = pending.popleft()
            for j in range(max(0, at - first), len(commands)):
                command = commands[j]
                if type(command) is _STEP:
                    op, addr, seq, foreign, _ = REC.unpack_from(blob, j * REC.size)
                    if op == OP_STEP and command.timeline is not self.timeline:
                        command.timeline._native.tl_complete(addr, seq, foreign)
                elif error is not None:
                    self._skip(command, error)
        _lanes.sweep()


# -- the engine's own encoders ----------------------------------------------------------------


def _lane_signal(sig: Any) -> bool:
    """Whether a native store may complete ``sig``: our own slot (its wake word kept), no
    peers in other processes, not closed."""
    return sig._wake_at is not None and not sig._peers and not sig._closed


def _signal(c: Any) -> Native | None:
    sig, value = c.signal, c.value
    if type(value) is not int or not _lane_signal(sig):
        return None
    v = value if value < 1 << 63 else value - (1 << 64)
    return _pack(OP_SIGNAL, sig._addr, v, sig._fd, 0), sig, None


def _stamp(c: Any) -> Native | None:
    sig = c.signal
    if not _lane_signal(sig):
        return None
    return _pack(OP_STAMP, sig._addr, 0, 0, 0), sig, None


def _barrier(c: Any) -> Native:
    return _NOP, None, None


def _step(c: Any) -> Native | None:
    tl = c.timeline
    addr = tl.c_address
    if addr is None:
        return None
    # the timeline as the "signal": this lane is noted on it, so closing it waits for the lane
    seq = c.seq
    if seq >= 1 << 63:  # the C timeline takes steps modulo 2**64 (see lane_c.py), as int64
        seq = (seq + (1 << 63)) % (1 << 64) - (1 << 63)
    return _pack(OP_STEP, addr, seq, int(tl.take_foreign(c.seq)), 0), tl, None
