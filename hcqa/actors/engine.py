"""Engines: one persistent thread per device queue, the queue's "hardware".

Theory of operation
-------------------
An engine owns one thread that takes *runs* of commands (lists, in queue
order) from its inbox and executes them one by one, dispatching on the
command's type through a table: the device supplies the handlers for the work
(``Exec``, ``Copy``, ``Load``); the engine itself handles the bookkeeping
(``Signal``, ``Timestamp``, ``MemoryBarrier``, ``Step``). Kernels and copies
release the GIL (numpy, ctypes), so an engine computes while the event loop
routes.

The inbox is a deque and a *doorbell* eventfd: ``put`` appends the run and, only
when the thread said it is going to sleep, writes the bell; the thread sleeps in a
blocking read of the bell (GIL released). A thread blocked in an eventfd read wakes
measurably faster than one blocked on a lock (``SimpleQueue``), and a burst of runs
rings once. No wake-up is lost: the thread marks itself sleeping *before* it looks
at the deque a last time, and ``put`` appends *before* it reads the mark (the GIL
orders the four steps). The bell is closed by :meth:`Engine.join` once the thread
has exited -- never while it may still read it.

``run_inline`` executes a run on the calling thread instead, through the same
table and fault handling; the queue actor uses it for short copies when the
queue is idle (see ``actor.py``).

Completion is reported only through signals: a ``Signal`` command writes the
slot and the eventfd; a ``Step`` advances the device timeline. The engine never
calls into trio.

Faults: when a handler raises (or the thread itself dies), the engine asks
the device to fault (which breaks the device's signals with one
:class:`~hcqa.errors.DeviceFault`) and
from then on executes nothing: every later ``Signal`` it is handed breaks its
signal with the device's error instead of setting it, so nobody waits for work
that will never run. Cancellation (closing a device by an exception) works the
same way, through a flag checked between commands: a running kernel can't be
interrupted, it finishes first.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from hcqa import commands as cmd
from hcqa.signals import Signal

__all__ = ["Engine"]

Handler = Callable[[Any], None]
_EXEC = cmd.Exec
_SIGNAL = cmd.Signal

# Tracing hook (set by hcqa/trace/ while a Tracer records device activity, else None).
# The engine reads it once per run: ``trace_hook.engine_run(engine, run, table)`` returns
# the handler table to use for that run (the same handlers, wrapped to record time ranges).
# A queue actor also calls ``trace_hook.sent(engine, commands)`` for each submission it is
# handed (served work's flows into its kernels), and ``waited`` after a Wait it awaited.
trace_hook: Any = None

# The values of the latest ``Bind`` this thread ran: an engine thread's Python kernels
# resolve variables left in their vals from them (a graph replay's patched commands).
bound = threading.local()


def resolve_bound(vals: tuple[Any, ...]) -> tuple[Any, ...]:
    """``vals`` with every variable or expression replaced by its value from the latest
    ``Bind`` this thread ran."""
    values = bound.values
    return tuple([v if type(v) is int else values[v] for v in vals])


class Engine:
    """A thread that executes runs of commands for one queue.

    ``error`` is the device's sticky error (None while healthy); ``on_fault(command,
    exc)`` is called in the engine thread when a handler raises, and must set it.
    """

    def __init__(
        self,
        name: str,
        handlers: dict[type, Handler],
        *,
        on_fault: Callable[[Any, BaseException], None],
        native: bool = False,
    ) -> None:
        self.name = name
        # The device runs an Exec that carries a ready native call exactly by calling it
        # (see ``_execute``); else every Exec goes through the device's handler.
        self._native = native
        self._inbox: collections.deque[Iterable[Any] | None] = collections.deque()
        self._bell = os.eventfd(0, os.EFD_CLOEXEC)  # the thread blocks reading it
        self._sleeping = False  # the thread is (about to be) blocked on the bell
        self._bell_closed = False
        self._table: dict[type, Handler] = {
            cmd.Signal: self._signal,
            cmd.Timestamp: self._timestamp,
            cmd.MemoryBarrier: self._barrier,
            cmd.Bind: self._bind,
            cmd.Step: self._step,
            **handlers,
        }
        # The device's sticky error (a fault, a hang, or "closed, cancelled"): set by the
        # device from any thread, read once per command here. Once set, nothing runs.
        self.error: BaseException | None = None
        self.timeline: Any = None  # the owning device's timeline (set by the device)
        self._dead = False
        self._on_fault = on_fault
        try:
            self.exited = Signal(name=f"{name} engine exit")
        except BaseException:  # (no fd left, say): the bell is ours to close
            self._bell_closed = True
            os.close(self._bell)
            raise
        self._thread = threading.Thread(target=self._main, name=f"hcqa {name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, run: Iterable[Any] | None) -> None:
        """Queue a run of commands (called from the actor's task); ``None`` ends the thread."""
        self._inbox.append(run)
        if self._sleeping:  # read after the append: see the module doc
            self._sleeping = False
            self._ring()
        if self._dead:  # nobody will run it: skip it here (breaking its signals)
            self._drain_dead()

    def _ring(self) -> None:
        if not self._bell_closed:
            os.eventfd_write(self._bell, 1)

    def _drain_dead(self) -> None:
        inbox = self._inbox
        while inbox:
            run = inbox.popleft()
            for command in run or ():
                self._skip(command, self.error)

    def stop(self) -> None:
        """Ask the thread to exit once it has handled everything queued before."""
        self.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Join the thread; True when it has exited (its doorbell is closed then)."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        if not self._bell_closed:
            self._bell_closed = True
            os.close(self._bell)
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread ----------------------------------------------------------------------

    def _next(self) -> Iterable[Any] | None:
        """The next run, sleeping on the bell while there is none."""
        inbox = self._inbox
        while not inbox:
            self._sleeping = True  # before the last look: see the module doc
            if inbox:
                self._sleeping = False
                break
            os.eventfd_read(self._bell)  # GIL released while blocked
        return inbox.popleft()

    def _main(self) -> None:
        handlers = self._table
        died: BaseException | None = None
        try:
            while (run := self._next()) is not None:
                hook = trace_hook  # tracing: one global read per run
                table = handlers if hook is None else hook.engine_run(self, run, handlers)
                self._execute(run, table)
                del run  # not kept alive while asleep: its buffers and host arrays are freed
        except BaseException as exc:  # an error outside any handler: the thread dies
            died = exc
            raise
        finally:
            if died is not None:
                self._died(died)
            self.exited._set_from_engine(1)

    def _died(self, died: BaseException) -> None:
        """The thread dies of ``died`` (an error outside any handler): fault the device with
        it, and skip what was queued behind the fatal run."""
        error = RuntimeError(f"engine thread {self.name!r} died: {died!r}")
        error.__cause__ = died
        self._on_fault(None, error)
        self._dead = True
        self._drain_dead()

    def _execute(self, run: Iterable[Any], table: dict[type, Handler]) -> None:
        # Two commands skip the handler frame unless a tracer wraps the handlers: a
        # Signal (the engine's own bookkeeping) and, on a native device, an Exec that
        # carries its ready native call (a C kernel with concrete arguments).
        direct = table is self._table
        native = direct and self._native
        for command in run:
            error = self.error
            if error is not None:
                self._skip(command, error)
                continue
            kind = type(command)
            try:
                if kind is _EXEC and native and command.call is not None:
                    command.call()
                elif kind is _SIGNAL and direct:
                    command.signal._set_from_engine(command.value)
                else:
                    handler = table.get(kind)
                    if handler is None:
                        raise TypeError(
                            f"engine {self.name!r} has no handler for {kind.__name__} commands"
                        )
                    handler(command)
            except BaseException as exc:
                self._on_fault(command, exc)
                self._skip(command, self.error)

    def run_inline(self, run: list[Any]) -> None:
        """Execute ``run`` now, on the calling thread, exactly as the thread would (same
        handlers, same fault handling). The caller guarantees the queue is idle: nothing
        queued or running before it (so queue order holds) and no tracer recording."""
        self._execute(run, self._table)

    def _skip(self, command: Any, error: BaseException | None) -> None:
        """Not executing ``command``: its signal must not be left unset forever."""
        kind = type(command)
        if error is not None and kind is cmd.Signal:
            command.signal._break(error)
        elif kind is cmd.Step and command.timeline is not self.timeline:
            # Another device's step (the source of a transfer): that device did nothing
            # wrong, and only read; its timeline must go on.
            command.timeline.complete(command.seq)

    # -- bookkeeping handlers --------------------------------------------------------------

    @staticmethod
    def _signal(c: Any) -> None:
        c.signal._set_from_engine(c.value)

    @staticmethod
    def _timestamp(c: Any) -> None:
        c.signal._stamp_from_engine(time.monotonic_ns())

    @staticmethod
    def _barrier(c: Any) -> None:
        pass  # host memory: a Python thread's stores are visible once it moves on

    @staticmethod
    def _bind(c: Any) -> None:
        bound.values = c.values  # for the kernels after it in this thread (see Bind)

    @staticmethod
    def _step(c: Any) -> None:
        c.timeline.complete(c.seq)
