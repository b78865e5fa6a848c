"""How a device fails: sticky faults, hangs, and errors that say where.

Theory of operation
-------------------
A device has one *sticky* error, ``_error``. The first failure sets it, under a lock
because engines report from their threads: a kernel or copy raising in an engine
(``_on_engine_fault``: a :class:`~hcqa.errors.DeviceFault` naming the device, the queue
and the command, its cause chained), a wait that reached its hang limit (``_hang``: the
:class:`~hcqa.errors.SignalTimeout` gains the queues that are behind, so the message says
where the device is stuck), or a close that found an engine stuck (``_hung_at_close``).
Setting it tells both engines to run nothing more and breaks every signal of the
device -- its timeline's and its queues' -- with that one instance, so every waiter
raises the same error object and nobody waits for work that will never run. From then
on ``_check_usable`` raises it at every enqueue; it is marked observed once raised to a
caller, so a close does not report it a second time.

Attribution. While :data:`hcqa.errors.work_owner` is set, every batch queued records
``(first, last, owner, commands)`` -- the range of queue-signal values it sets -- in its
queue's ``_owners`` (``_own``; finished batches are dropped as new ones come). A fault
in a command of the cpu engine (which sets the queue signal, in order, from the thread
that reports the fault) lies in the batch whose range holds ``signal + 1``; any other
executor (a driver's, whose signal may lag) is attributed only when exactly one unfinished
batch holds the failing command. The DeviceFault's ``owner`` is that batch's owner, or
None when no batch matches (an unowned batch, a fault outside any command).

This is a mixin of :class:`~hcqa.devices.base.Device`, which sets the attributes
declared below.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from hcqa import commands as cmd
from hcqa.actors.engine import Engine
from hcqa.errors import DeviceClosed, DeviceFault, HcqaError, SignalTimeout

if TYPE_CHECKING:
    from hcqa.actors import QueueActor
    from hcqa.devices.timeline import Timeline

__all__ = ["Faults"]


class Faults:
    """The sticky error of a device (see the module doc)."""

    name: str
    hang_limit: float
    compute: QueueActor
    copy: QueueActor
    _queues: dict[str, QueueActor]
    _timeline: Timeline
    _error: BaseException | None
    _error_lock: threading.Lock
    _closed: bool
    _closing: bool
    _hung: bool
    _owners: dict[QueueActor, deque[tuple[int, int, object, list[Any]]]]

    # -- errors ------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed or self._closing:
            raise DeviceClosed(f"{self.name} is closed")
        if self._error is not None:
            self._raise_error()

    def _raise_error(self) -> None:
        err = self._error
        assert err is not None
        if isinstance(err, HcqaError):
            err.observed = True
        raise err

    def _fault(self, exc: BaseException) -> None:
        """Make ``exc`` the device's sticky error and break its signals with it (any thread)."""
        with self._error_lock:
            if self._error is not None:
                return
            self._error = exc
        for actor in self._queues.values():
            actor.engine.error = exc
        for s in (*self._timeline.signals, self.compute.signal, self.copy.signal):
            s._break(exc)

    def _on_engine_fault(self, kind: str, command: Any, exc: BaseException) -> None:
        what = _describe(command)
        fault = DeviceFault(
            f"{self.name}: {what} failed on the {kind} queue: {type(exc).__name__}: {exc}",
            device=self.name,
            queue=kind,
        )
        fault.__cause__ = exc
        if command is not None:
            fault.owner = self._owner_of(self._queues[kind], command)
        self._fault(fault)

    # -- attribution -------------------------------------------------------------------------

    def _own(self, actor: QueueActor, first: int, last: int, owner: object, run: list[Any]) -> None:
        """Note that the batch setting ``actor``'s signal to ``first..last`` is ``owner``'s
        (the loop's thread, before the batch is sent)."""
        owned = self._owners.get(actor)
        if owned is None:
            owned = self._owners[actor] = deque()
        done = actor.signal.value
        while owned and owned[0][1] <= done:
            owned.popleft()
        owned.append((first, last, owner, run))

    def _owner_of(self, actor: QueueActor, command: Any) -> object | None:
        """The owner of the batch of ``actor`` whose ``command`` failed (any thread)."""
        owned = self._owners.get(actor)
        if not owned:
            return None
        done = actor.signal.value
        pending = [e for e in list(owned) if e[1] > done]  # list(): one copy under the GIL
        if isinstance(actor.engine, Engine):  # in order, signals set by this very thread
            return next((e[2] for e in pending if e[0] <= done + 1), None)
        holders = [e for e in pending if any(c is command for c in e[3])]
        return holders[0][2] if len(holders) == 1 else None

    def _hang(self, exc: BaseException) -> None:
        """A SignalTimeout reached a caller: the device is hung. Its message gains the
        queues that are behind, so the error says where the device is stuck."""
        behind = [(a, a.signal.value) for a in self._queues.values()]
        behind = [(a, done) for a, done in behind if done < a.value]
        if behind and isinstance(exc, SignalTimeout) and exc.args:
            stuck = ", ".join(f"{a.name} queue at {done} of {a.value}" for a, done in behind)
            exc.args = (f"{exc.args[0]}; stuck: {stuck}", *exc.args[1:])
            exc.queue = behind[0][0].name
        self._hung = True
        self._fault(exc)

    def _hung_at_close(self, actor: QueueActor) -> None:
        """Closing found ``actor``'s engine stuck (no progress for the hang limit)."""
        self._hung = True
        stuck = actor.signal.value
        self._fault(
            SignalTimeout(
                f"{actor.name} queue: no progress for the hang limit of {self.hang_limit:g} s "
                f"while closing (at {stuck} of {actor.value}): a kernel or copy is stuck",
                signal=actor.signal.name,
                expected=actor.value,
                seen=stuck,
            )
        )


def _describe(command: Any) -> str:
    if command is None:
        return "the engine thread"
    if isinstance(command, cmd.Exec):
        return f"program {command.program.name!r}"
    if isinstance(command, cmd.Copy):
        return f"copy of {command.nbytes} bytes"
    if isinstance(command, cmd.Load):
        return f"load of {command.path!r}"
    names = getattr(command, "names", None)
    if names is not None:
        return f"native run of {', '.join(map(repr, names))}"
    return type(command).__name__
