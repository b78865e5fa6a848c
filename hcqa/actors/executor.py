"""The executor seam: what a queue actor hands its runs of commands to.

Theory of operation
-------------------
A queue actor (``actor.py``) awaits every ``Wait`` itself, on the event loop, and hands
each *run* of other commands -- in queue order, never holding a ``Wait`` -- to its
queue's executor with :meth:`Executor.put`. How the run then executes is the backend's
business: the cpu backend's executor is an :class:`~hcqa.actors.engine.Engine` (a
thread with a handler table); another backend may enqueue the run onto a driver queue
and learn of completion from a native callback.

Whatever it does, an executor keeps these promises:

* **Order**: runs execute in the order they were put, commands in the order of the run.
* **Completion through signals only**: a ``Signal(signal, value)`` command sets the
  signal once everything before it is done (``signal._set_from_engine(value)``, callable
  from any thread: it writes the slot, then the eventfd); a ``Timestamp(signal)``
  stores the device clock (``signal._stamp_from_engine(ns)``); a ``Step(timeline, seq)``
  completes a timeline step (``timeline.complete(seq)``). Nothing else wakes trio, and
  ``put`` never blocks and never calls into trio.
* **Faults**: a command that fails is reported with the ``on_fault(command, exc)`` the
  device gave when it built the executor (the device stores its sticky error, which it
  also sets as ``error`` here). From then on -- and whenever ``error`` is set, as it is on
  cancellation -- the executor executes nothing: it breaks the signal of every
  ``Signal`` command it is handed with ``error`` and completes other devices' ``Step`` s
  (they did nothing wrong), so nobody waits for work that will never run.
* **Lifetime**: ``start`` before the first ``put``; ``stop`` (or ``put(None)``) after the
  last; ``exited`` is set to 1 once everything put was executed or skipped; ``join``
  frees what the executor holds (threads, fds) and says whether it has stopped.
  ``alive`` is False once nothing of it can still touch device memory or signals.
* **Inline**: ``run_inline(run)`` executes a run now, on the caller's thread, with the
  same fault handling; the actor only asks when the queue is idle (nothing put before
  it is unfinished) and the device's ``_inline`` allowed the command.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from hcqa.signals import Signal

__all__ = ["Executor", "OnFault"]

OnFault = Callable[[Any, BaseException], None]
"""``on_fault(command, exc)``: called (from any thread) when ``command`` failed with ``exc``;
``command`` is None when the executor itself died outside any command."""


class Executor(Protocol):
    """Executes runs of commands for one device queue (see the module doc)."""

    name: str
    error: BaseException | None  # the device's sticky error: once set, nothing runs
    timeline: Any  # the owning device's Timeline (set by the device after building it)
    exited: Signal  # set to 1 once stopped, with everything put executed or skipped

    def start(self) -> None: ...

    def put(self, run: list[Any] | None) -> None: ...

    def run_inline(self, run: list[Any]) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> bool: ...

    @property
    def alive(self) -> bool: ...
