"""The waiters a signal parks: a trio task, an asyncio task or a thread, and the state
of its wake-up.

Theory of operation
-------------------
A waiter is listed on its signal while it waits. Its ``state`` says whether a wake-up
is on its way (``WOKEN``, with ``msg`` saying what for: the target was reached, or
the waiter now *owns* the eventfd) or it left (``ABORTED``). A trio task parks in
``wait_task_rescheduled`` and is woken by ``reschedule`` -- from another thread only
through its run's ``run_sync_soon``, and only while ``parked`` is still true; a thread
parks on a semaphore, where a wake that lands early is a harmless spurious wake-up; an
asyncio task parks on a Future (``future``, set in ``loop``'s thread; see ``_signals/aio_wait.py``).
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import outcome
import trio

__all__ = ["DONE", "OWN", "State", "Waiter"]


class State(enum.Enum):
    PARKED = "parked"
    WOKEN = "woken"
    ABORTED = "aborted"


DONE = "done"
OWN = "own"


class Waiter:
    """One parked waiter: a trio task (task set) or a thread (lock set)."""

    __slots__ = (
        "expired",
        "future",
        "lock",
        "loop",
        "msg",
        "parked",
        "state",
        "target",
        "task",
        "thread",
        "token",
    )

    def __init__(
        self,
        target: int,
        *,
        trio_task: bool = False,
        task: trio.lowlevel.Task | None = None,
        token: trio.lowlevel.TrioToken | None = None,
    ) -> None:
        """A thread's waiter, or a trio task's: ``trio_task=True`` looks up the current
        task and run, or the caller passes them (``task``, ``token``: the park path of
        a trio wait has them at hand)."""
        self.target = target
        self.state = State.PARKED
        self.msg = DONE
        self.expired = False  # its hang limit passed with no progress (``_signals/rereader.py``)
        self.parked = False  # a trio task inside wait_task_rescheduled (trio thread only)
        self.thread = threading.get_ident()
        if trio_task:
            task = trio.lowlevel.current_task()
            token = trio.lowlevel.current_trio_token()
        self.task = task
        self.token = token
        # A thread's semaphore is made when it first parks (see ``park_lock``): most
        # thread waits own the eventfd and never park, and a semaphore costs microseconds.
        self.lock: threading.Semaphore | None = None
        self.future: Any = None  # an asyncio waiter's Future, and its loop
        self.loop: Any = None

    def park_lock(self) -> None:
        """A thread about to be listed as parked: make the semaphore it will block on.

        A semaphore, not a lock: a wake that lands while the thread is not blocked leaves
        a count behind (a spurious wake-up the wait loop absorbs) instead of raising on a
        second release. Called under the signal's lock, before the state says PARKED, so
        whoever wakes the waiter finds it."""
        if self.task is None and self.future is None and self.lock is None:
            self.lock = threading.Semaphore(0)

    def deliver(self) -> None:
        """Wake the waiter (its state and ``msg`` are set, under the signal's lock)."""
        if self.task is not None:
            assert self.token is not None
            if self.thread == threading.get_ident():
                self._wake_task()
            else:
                try:
                    self.token.run_sync_soon(self._wake_task)
                except trio.RunFinishedError:
                    pass  # that run is gone, and its task with it
        elif self.future is not None:
            if self.thread == threading.get_ident():
                _set(self.future)
            else:
                try:
                    self.loop.call_soon_threadsafe(_set, self.future)
                except RuntimeError:
                    pass  # that loop is closed, and its task with it
        else:
            assert self.lock is not None
            self.lock.release()

    def _wake_task(self) -> None:
        """In the waiter's trio thread: reschedule it if it is (still) parked."""
        if self.parked:
            self.parked = False
            assert self.task is not None
            trio.lowlevel.reschedule(self.task, outcome.Value(self.msg))


def _set(future: Any) -> None:
    if not future.done():
        future.set_result(None)
