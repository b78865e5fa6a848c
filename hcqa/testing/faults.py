"""Fault injection: kernels that fail or hang, copies and loads that fail, engines that die.

Theory of operation
-------------------
Every helper works on an open device and goes through the paths real faults take: a kernel
raises in the engine thread (``failing_kernel``) or blocks it until a :class:`Gate` opens
(``hanging_kernel``); an :class:`Injection` swaps the handler of the next copy or load on the
device's copy engine for one that raises, and puts the real handler back once it fired
(``fail_next_copy``, ``fail_next_load``); ``kill_engine`` queues an object whose iteration
raises, so the exception escapes the engine's loop outside any command's handler. The device
then faults, hangs or dies exactly as in production (``hcqa.testing`` tells the story).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import attrs

from hcqa import commands as cmd
from hcqa.actors.engine import Engine
from hcqa.devices.base import Device
from hcqa.devices.program import Program
from hcqa.devices.sizes import check_int
from hcqa.errors import InvalidCommand
from hcqa.signals import Fence, Signal

__all__ = [
    "EngineKilled",
    "Gate",
    "InjectedFault",
    "Injection",
    "fail_next_copy",
    "fail_next_load",
    "failing_kernel",
    "hanging_kernel",
    "kill_engine",
]

QueueKind = Literal["compute", "copy"]
ExcSpec = BaseException | type[BaseException] | None


class InjectedFault(Exception):
    """What the helpers raise when no exception is given."""


class EngineKilled(SystemExit):
    """Raised inside an engine thread by :func:`kill_engine` (by default).

    A ``SystemExit``, so that the default ``threading.excepthook`` lets the thread die without
    printing a traceback. pytest installs its own hook and still reports it, as a
    ``PytestUnhandledThreadExceptionWarning``: filter that warning on such tests."""


def _device(device: object) -> Device:
    if not isinstance(device, Device):
        raise InvalidCommand(f"'device' must be an open hcqa device (got {type(device).__name__})")
    device._check_usable()
    return device


def _exception(exc: ExcSpec, default: str) -> BaseException:
    if exc is None:
        return InjectedFault(default)
    if isinstance(exc, BaseException):
        return exc
    if isinstance(exc, type) and issubclass(exc, BaseException):
        return exc(default)
    raise InvalidCommand(f"'exc' must be an exception or an exception class (got {exc!r})")


# -- kernels ----------------------------------------------------------------------------------


def failing_kernel(
    device: Device,
    exc: ExcSpec = None,
    *,
    name: str = "failing_kernel",
    after: int = 0,
) -> Program:
    """A Python program on ``device`` whose runs raise ``exc``.

    It takes any number of buffers and vals (and, like every program, writes its first buffer
    without changing it). The first ``after`` runs succeed; every later one raises. ``exc`` may be
    an instance (raised as is, so ``fault.__cause__ is exc``) or a class (instantiated with a
    message); the default is :class:`InjectedFault`.
    """
    dev = _device(device)
    error = _exception(exc, f"injected fault in kernel {name!r}")
    remaining = check_int("after", after, minimum=0)
    lock = threading.Lock()

    def kernel(*args: Any) -> None:
        nonlocal remaining
        with lock:
            if remaining > 0:
                remaining -= 1
                return
        raise error

    return dev.program(name, kernel)


@attrs.define(eq=False)
class Gate:
    """What holds the runs of a :func:`hanging_kernel`.

    ``started`` counts the runs that have entered the kernel (``await gate.started.wait(1)`` to
    know the first is running, no sleeping); ``release()`` (or calling the gate) lets every run,
    present and future, go through. As a context manager it releases on exit.
    """

    started: Signal
    max_hold: float | None
    _event: threading.Event = attrs.field(factory=threading.Event)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def released(self) -> bool:
        return self._event.is_set()

    def release(self) -> None:
        """Let the held runs finish (idempotent; any thread)."""
        self._event.set()

    def __call__(self) -> None:
        self.release()

    def close(self) -> None:
        """Release, then give back the ``started`` signal's slot and eventfd."""
        self.release()
        self.started.close()

    def __enter__(self) -> Gate:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def _hold(self) -> None:
        """Engine thread: count the run in, then block until released (or max_hold)."""
        with self._lock:
            if not self.started.statistics().closed:
                self.started.value = self.started.value + 1
        if not self._event.wait(self.max_hold):
            raise InjectedFault(
                f"hanging kernel was never released (held for max_hold = {self.max_hold:g} s)"
            )


def hanging_kernel(
    device: Device,
    *,
    name: str = "hanging_kernel",
    max_hold: float | None = 60.0,
) -> tuple[Program, Gate]:
    """``(program, gate)``: a Python program whose runs block until ``gate.release()``.

    The program takes any number of buffers and vals and leaves them unchanged. While a run is
    held, the device's compute engine is busy: awaiting the run's fence (or anything queued
    behind it) raises :class:`~hcqa.SignalTimeout` after the device's hang limit. A run still
    held after ``max_hold`` seconds (``None``: forever) raises :class:`InjectedFault` instead.
    """
    dev = _device(device)
    if max_hold is not None and (
        isinstance(max_hold, bool) or not isinstance(max_hold, (int, float)) or not max_hold > 0
    ):
        raise InvalidCommand(
            f"'max_hold' must be a number of seconds > 0 or None (got {max_hold!r})"
        )
    gate = Gate(started=Signal(name=f"{name} started"), max_hold=max_hold)

    def kernel(*args: Any) -> None:
        gate._hold()

    return dev.program(name, kernel), gate


# -- copies ------------------------------------------------------------------------------------


@attrs.define(eq=False)
class Injection:
    """An armed :func:`fail_next_copy` / :func:`fail_next_load`.

    ``fired`` counts the commands it failed; ``remaining`` how many more it will fail. It
    disarms itself (restoring the device's handler) once ``remaining`` reaches 0; ``disarm()``
    (or leaving it as a context manager) does so at once.
    """

    device: Device
    command: type
    exc: BaseException
    remaining: int
    fired: int = 0
    _table: dict[type, Callable[[Any], None]] = attrs.field(factory=dict, repr=False)
    _original: Callable[[Any], None] | None = attrs.field(default=None, repr=False)
    _armed: bool = attrs.field(default=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)

    @property
    def armed(self) -> bool:
        return self._armed

    def _arm(self) -> None:
        with self._lock:
            self._original = self._table[self.command]
            self._table[self.command] = self._handler
            self._armed = True

    def _handler(self, command: Any) -> None:
        """Engine thread: fail this command while armed, else run the device's handler."""
        with self._lock:
            fail = self._armed and self.remaining > 0
            if fail:
                self.remaining -= 1
                self.fired += 1
                if self.remaining == 0:
                    self._restore()
        if fail:
            raise self.exc
        assert self._original is not None
        self._original(command)

    def _restore(self) -> None:
        if self._armed:
            if self._table.get(self.command) == self._handler and self._original is not None:
                self._table[self.command] = self._original
            self._armed = False

    def disarm(self) -> None:
        """Stop failing commands (idempotent)."""
        with self._lock:
            self._restore()

    def __enter__(self) -> Injection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.disarm()


def _engine_thread(device: Device, queue: str) -> Engine:
    """The queue's executor, which must be an engine thread (the cpu backend's kind)."""
    engine = device._queues[queue].engine
    if not isinstance(engine, Engine):
        raise InvalidCommand(
            f"{device.name} {queue} queue must run on an engine thread to inject faults "
            f"(got a {type(engine).__name__})"
        )
    return engine


def _inject(device: Device, command: type, exc: BaseException, count: int) -> Injection:
    engine = _engine_thread(device, "copy")
    table: dict[type, Callable[[Any], None]] = engine._table
    if command not in table:
        raise InvalidCommand(
            f"{device.name} copy engine must handle {command.__name__} commands to fail them "
            f"(got handlers for {sorted(t.__name__ for t in table)})"
        )
    injection = Injection(device=device, command=command, exc=exc, remaining=count, table=table)
    injection._arm()
    return injection


def fail_next_copy(device: Device, exc: ExcSpec = None, *, count: int = 1) -> Injection:
    """Make the next ``count`` copies the device's copy engine runs raise ``exc``.

    That is ``copyin``, ``copyout``, ``Queue.copy`` on a copy queue, and ``hcqa.transfer``
    *into* a buffer of this device (a transfer runs on its destination's copy queue). The
    awaiting caller gets a :class:`~hcqa.DeviceFault` with ``queue == "copy"`` and ``exc`` as its
    cause; the device stays faulted. Copies already running are not affected.
    """
    dev = _device(device)
    n = check_int("count", count, minimum=1)
    return _inject(dev, cmd.Copy, _exception(exc, f"injected fault in a copy on {dev.name}"), n)


def fail_next_load(device: Device, exc: ExcSpec = None, *, count: int = 1) -> Injection:
    """Make the next ``count`` ``Buffer.load`` file reads of the device raise ``exc``."""
    dev = _device(device)
    n = check_int("count", count, minimum=1)
    return _inject(dev, cmd.Load, _exception(exc, f"injected fault in a load on {dev.name}"), n)


# -- engines -----------------------------------------------------------------------------------


class _Poison:
    """A run whose iteration raises: the exception escapes the engine's loop itself."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __iter__(self) -> Any:
        raise self.exc


def kill_engine(device: Device, queue: QueueKind = "compute", exc: ExcSpec = None) -> Fence:
    """Make the engine thread of ``device``'s ``queue`` die; a Fence reached once it has.

    The thread first finishes the runs handed to it before; then an exception (``exc``, by
    default :class:`EngineKilled`) escapes its loop, outside any command's handler, as a bug in
    the engine would. The device faults with a :class:`~hcqa.DeviceFault` saying ``engine thread
    ... died``: waits on its timeline raise it at once, later enqueues raise it. The returned
    fence is reached when the thread has left its loop and faulted the device (it ends a moment
    later: ``device.compute.engine.join()``). An ``exc`` that is not a ``SystemExit`` is also
    printed by the default ``threading.excepthook``; pytest reports either kind as a
    ``PytestUnhandledThreadExceptionWarning``.
    """
    dev = _device(device)
    if queue not in ("compute", "copy"):
        raise InvalidCommand(f"'queue' must be 'compute' or 'copy' (got {queue!r})")
    engine = _engine_thread(dev, queue)
    error = _exception(exc, f"engine {engine.name!r} killed by hcqa.testing.kill_engine")
    if exc is None:
        error = EngineKilled(f"engine {engine.name!r} killed by hcqa.testing.kill_engine")
    engine.put(_Poison(error))
    return Fence(engine.exited, 1, context=f"{engine.name} engine exit")
