"""Hosting hcqa under asyncio: a trio guest run on the caller's asyncio loop.

Theory of operation
-------------------
hcqa's queue actors are trio tasks. When the caller is an asyncio task (FastAPI,
uvicorn, aiohttp), the first ``open_devices`` on a loop starts a *host*: a trio
guest run (``trio.lowlevel.start_guest_run``) whose ticks run as callbacks of
that asyncio loop (``loop.call_soon`` / ``loop.call_soon_threadsafe``). trio's
own I/O wait runs in a thread from trio's thread cache, as guest mode always
does; hcqa starts no thread of its own to run either loop. The host's main task
holds a nursery; the host ends when the last hcqa block opened on its loop closes
(or when an explicit :func:`open_asyncio_host` block ends), and the block waits
for that, so nothing of hcqa runs after it.

Between guest ticks trio's run context stays installed in the loop's thread, so
*sync* trio calls work from asyncio code: a ``send_nowait`` to an actor's channel,
``reschedule``, ``CancelScope.cancel`` and ``nursery.start_soon`` (trio wakes its
own I/O thread so the tick comes promptly). Only the current *task* is missing:
``trio.lowlevel.in_trio_task()`` is False in an asyncio task, and that is the test
every public await makes (``sniffio`` names the library when it is not trio).

Three ways an asyncio caller's await is served:

* ``await fence`` / ``Signal.wait`` (and so ``copyin``, ``copyout``, ``transfer``,
  ``Program.timed``, ``synchronize``) park an asyncio Future on the signal
  directly, see ``hcqa/_signals/aio_wait.py``: no trio hop at all;
* block-shaped calls (``open_devices``, ``open_process_pipeline``) run as a trio
  task that enters the context manager, hands the value over, and leaves it with
  the body's exception (so the block drains or cancels exactly as under trio) --
  :func:`hosted`; an opener decorated with :func:`rehosts` does that by itself when
  an asyncio task enters it. An asyncio cancellation while the block is entered
  cancels the entering (a cancel scope around it), so a set-up is cut short at the
  await it is in, as a trio cancellation would cut it;
* other awaits (graph replay, ``Pipeline``, a process pipeline call,
  ``Queue.submit_async``) run as a trio task in the host's nursery -- :func:`call`.
  Its result or exception (the same instance, never wrapped) goes back through an
  asyncio Future. An asyncio cancellation cancels that task's cancel scope, waits
  for it to finish (queued device work still completes, as under trio) and then
  re-raises ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Generic, ParamSpec, TypeVar

import outcome
import sniffio
import trio

from hcqa._signals import aio_readers as _aio_readers
from hcqa.errors import DeviceClosed, HcqaError, InvalidCommand

__all__ = ["asyncio_caller", "call", "checkpoint", "hosted", "open_asyncio_host", "rehosts"]

T = TypeVar("T")
P = ParamSpec("P")


def asyncio_caller() -> bool:
    """True when the caller is an asyncio task; False in a trio task (or outside both)."""
    if trio.lowlevel.in_trio_task():
        return False
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return False  # trio raises its own error for the caller
    if library == "asyncio":
        return True
    if library == "trio":
        return False
    raise HcqaError(f"hcqa runs under 'trio' or 'asyncio' (got {library!r})")


async def checkpoint() -> None:
    """A checkpoint of whichever library runs the caller."""
    if trio.lowlevel.in_trio_task():
        await trio.lowlevel.checkpoint()
    else:
        await asyncio.sleep(0)


class _Host:
    """One trio guest run on one asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.users = 0
        self.stopping = False
        self.nursery: trio.Nursery | None = None
        self.started: asyncio.Future[None] = loop.create_future()
        self.finished: asyncio.Future[outcome.Outcome[None]] = loop.create_future()
        self._stop = trio.Event()

    def start(self, instruments: Sequence[trio.abc.Instrument]) -> None:
        # The guest's tasks must not inherit the caller's context (sniffio's name,
        # a capture in progress): start it from an empty one.
        contextvars.Context().run(
            trio.lowlevel.start_guest_run,
            self._main,
            run_sync_soon_threadsafe=self.loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=self.loop.call_soon,
            done_callback=self._done,
            host_uses_signal_set_wakeup_fd=True,  # leave the loop's signal handling alone
            instruments=instruments,
        )

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            if not self.started.done():
                self.started.set_result(None)
            await self._stop.wait()
            nursery.cancel_scope.cancel()  # nothing is left by then; never wait on strays

    def _done(self, result: outcome.Outcome[None]) -> None:
        if _hosts.get(self.loop) is self:
            del _hosts[self.loop]
        _aio_readers.forget(self.loop)  # the eventfds of its devices' signals, kept between waits
        if not self.started.done():
            self.started.set_result(None)
        if not self.finished.done():
            self.finished.set_result(result)

    def stop(self) -> None:
        self.stopping = True
        self._stop.set()


_hosts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Host] = weakref.WeakKeyDictionary()

# The instruments of a host started without explicit ones: ``hcqa.trace`` sets this to its
# ``instruments_from_env`` when it is imported (``import hcqa`` imports it), so the core never
# imports the tracer; None (no instruments) before that.
default_instruments: Callable[[], list[trio.abc.Instrument]] | None = None


async def _settle(fut: asyncio.Future[Any]) -> bool:
    """Wait for ``fut`` whatever happens; True if the caller was cancelled meanwhile."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait((fut,))
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


async def _acquire(instruments: Sequence[trio.abc.Instrument] | None = None) -> _Host:
    loop = asyncio.get_running_loop()
    while True:
        host = _hosts.get(loop)
        if host is not None and host.stopping:
            await asyncio.wait((host.finished,))
            continue
        if host is None:
            if instruments is None:
                make = default_instruments
                instruments = make() if make is not None else []
            host = _hosts[loop] = _Host(loop)
            host.start(instruments)
        host.users += 1
        try:
            await asyncio.wait((host.started,))
        except BaseException:
            await _release(host)
            raise
        if host.nursery is None:  # the run ended before it began
            outcome_ = host.finished.result()
            await _release(host)
            outcome_.unwrap()
            raise DeviceClosed("hcqa's trio host on this asyncio loop ended at once")
        return host


async def _release(host: _Host) -> None:
    """Drop one user; the last one stops the host and waits until its run is over."""
    host.users -= 1
    if host.users > 0:
        return
    host.stop()
    cancelled = await _settle(host.finished)
    result = host.finished.result()
    if isinstance(result, outcome.Error):
        result.unwrap()
    if cancelled:
        raise asyncio.CancelledError


@asynccontextmanager
async def open_asyncio_host(
    *, instruments: Sequence[trio.abc.Instrument] = ()
) -> AsyncIterator[None]:
    """Host hcqa on the running asyncio loop for the block, with trio ``instruments``.

    Optional: the first hcqa block on a loop starts a host by itself (with
    ``hcqa.trace.instruments_from_env()``). Use this to trace (``instruments=
    [hcqa.Tracer(path)]``) or to keep one trio run across many device blocks."""
    instruments = list(instruments)
    for ins in instruments:
        if not isinstance(ins, trio.abc.Instrument):
            raise InvalidCommand(
                f"'instruments' must hold trio Instruments (got {type(ins).__name__})"
            )
    if not asyncio_caller():
        raise HcqaError("open_asyncio_host() must be called from an asyncio task (got trio)")
    loop = asyncio.get_running_loop()
    if loop in _hosts:
        raise HcqaError("this asyncio loop already hosts hcqa: open the host block first")
    host = await _acquire(instruments)
    try:
        yield
    finally:
        await _release(host)


def _current() -> _Host:
    host = _hosts.get(asyncio.get_running_loop())
    if host is None or host.nursery is None or host.stopping:
        raise DeviceClosed("no hcqa block is open on this asyncio loop (open_devices first)")
    return host


class _Call:
    __slots__ = ("cancelled", "done", "outcome", "scope")

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done
        self.outcome: outcome.Outcome[Any] | None = None
        self.scope: trio.CancelScope | None = None
        self.cancelled = False

    def finish(self, result: outcome.Outcome[Any]) -> None:
        self.outcome = result
        if not self.done.done():
            self.done.set_result(None)


async def _run_call(
    box: _Call, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    result: outcome.Outcome[Any] | None = None
    try:
        with trio.CancelScope() as box.scope:
            if box.cancelled:
                box.scope.cancel()
            result = outcome.Value(await fn(*args, **kwargs))
    except trio.Cancelled:
        result = outcome.Error(DeviceClosed("hcqa's trio host stopped during the call"))
        raise
    except BaseException as exc:  # handed to the asyncio caller as it is
        result = outcome.Error(exc)
    finally:
        if result is None:  # our scope was cancelled: the asyncio caller was
            result = outcome.Error(asyncio.CancelledError())
        box.finish(result)


def _task_name(what: Callable[..., Any] | str) -> str:
    """The trio task's name: the asyncio task it serves, and what it runs."""
    task = asyncio.current_task()
    who = task.get_name() if task is not None else "asyncio"
    label = what if isinstance(what, str) else getattr(what, "__qualname__", repr(what))
    return f"{who}: {label}"


async def call(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """From an asyncio task: ``await fn(*args, **kwargs)`` as a trio task of the loop's host."""
    host = _current()
    assert host.nursery is not None
    box = _Call(host.loop.create_future())
    host.nursery.start_soon(_run_call, box, fn, args, kwargs, name=_task_name(fn))
    try:
        await box.done
    except asyncio.CancelledError:
        box.cancelled = True
        if box.scope is not None:
            box.scope.cancel()
        box.done = host.loop.create_future()
        if box.outcome is None:
            await _settle(box.done)
        raise
    assert box.outcome is not None
    return box.outcome.unwrap()  # type: ignore[no-any-return]


class _Gate:
    """The hand-over between an asyncio block and the trio task holding its manager."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.entered: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.leave = trio.Event()
        self.value: Any = None
        self.body_error: BaseException | None = None
        self.outcome: outcome.Outcome[None] | None = None
        self.setup: trio.CancelScope | None = None  # around the manager's entering
        self.cancelled = False  # the asyncio caller was cancelled while it entered


async def _hold(gate: _Gate, make: Callable[[], AbstractAsyncContextManager[Any]]) -> None:
    result: outcome.Outcome[None] = outcome.Value(None)
    try:
        # An asyncio cancellation while the manager enters cancels this scope: the set-up
        # is cut short as a trio cancellation would cut it (see ``hosted``).
        with trio.CancelScope() as gate.setup:
            if gate.cancelled:
                gate.setup.cancel()
            async with make() as value:
                gate.setup = None  # entered: from here the body's exception leaves it
                gate.value = value
                gate.entered.set_result(None)
                await gate.leave.wait()
                if gate.body_error is not None:
                    raise gate.body_error
    except trio.Cancelled:
        result = outcome.Error(DeviceClosed("hcqa's trio host stopped inside a block"))
        raise
    except BaseException as exc:
        result = outcome.Error(exc)
    finally:
        gate.outcome = result
        if not gate.entered.done():
            gate.entered.set_result(None)
        gate.done.set_result(None)


@asynccontextmanager
async def hosted(
    make: Callable[[], AbstractAsyncContextManager[T]], label: str
) -> AsyncIterator[T]:
    """From an asyncio task: ``async with make() as value`` held by a trio task of the
    loop's host (started here if need be). The body's exception is raised inside the
    trio block, so the manager sees it exactly as under trio; what leaves the block is
    what the manager raised (the body's own exception, unwrapped, or its own). Cancelled
    while entering, the entering is cancelled (trio's Cancelled in the set-up)."""
    host = await _acquire()
    try:
        assert host.nursery is not None
        gate = _Gate(host.loop)
        host.nursery.start_soon(_hold, gate, make, name=_task_name(label))
        try:
            await asyncio.wait((gate.entered,))
        except asyncio.CancelledError as exc:
            # cut the set-up short (a trio cancellation of the entering task), or, if it
            # just finished, leave at once with the cancellation
            gate.cancelled = True
            if gate.setup is not None:
                gate.setup.cancel()
            gate.body_error = exc
            gate.leave.set()
            await _settle(gate.done)
            raise
        if gate.outcome is not None:  # entering failed
            await _settle(gate.done)
            gate.outcome.unwrap()
        error: BaseException | None = None
        try:
            yield gate.value
        except BaseException as exc:
            error = gate.body_error = exc
        gate.leave.set()
        cancelled = await _settle(gate.done)
        assert gate.outcome is not None
        if isinstance(gate.outcome, outcome.Error):
            gate.outcome.unwrap()
        if error is not None:
            raise error
        if cancelled:
            raise asyncio.CancelledError
    finally:
        await _release(host)


class _Rehosting(AbstractAsyncContextManager[T], Generic[T]):
    """An opener's block that decides, as it is entered, who holds it: the caller (trio)
    or a trio task of the loop's host (asyncio), see :func:`rehosts`."""

    def __init__(self, make: Callable[[], AbstractAsyncContextManager[T]], label: str) -> None:
        self._make = make
        self._label = label
        self._inner: AbstractAsyncContextManager[T] | None = None

    async def __aenter__(self) -> T:
        if self._inner is not None:
            raise RuntimeError(f"an {self._label}() block can be entered only once")
        self._inner = hosted(self._make, self._label) if asyncio_caller() else self._make()
        return await self._inner.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._inner is not None
        return await self._inner.__aexit__(*exc_info)


def rehosts(
    opener: Callable[P, AbstractAsyncContextManager[T]],
) -> Callable[P, AbstractAsyncContextManager[T]]:
    """Decorate an ``async with`` opener written for trio so that it works from asyncio too.

    Entered from an asyncio task, the block is held by a trio task of the loop's host
    with the same arguments (:func:`hosted`); entered from trio, it is the opener's own
    block. The opener itself is written for trio only."""

    @functools.wraps(opener)
    def open_block(*args: P.args, **kwargs: P.kwargs) -> AbstractAsyncContextManager[T]:
        return _Rehosting(functools.partial(opener, *args, **kwargs), opener.__name__)

    return open_block
