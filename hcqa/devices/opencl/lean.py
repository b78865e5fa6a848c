"""The lean enqueue of an OpenCL queue: a lone launch or copy with the least Python.

Theory of operation
-------------------
The common run -- one launch or copy, this queue's signal, this device's timeline step (and a
transfer's step on the other device) -- needs none of the general run loop
(``executor.py``): the native callback does all of its bookkeeping (``nativestores.py``). So
:meth:`LeanEnqueue._lean` fills the segment's slot *before* the driver call (with fast
wake-ups the driver's worker runs the command inside that call and the loop's thread resumes
with cold caches), and after it only registers the callback, lists the segment, flushes and
tidies.

When nothing else of the queue is in the driver, the callback is registered before any segment
is listed: a driver runs it at once, on the registering thread, for a command that already
completed -- on a pinned host (one CPU) PoCL's worker preempts the caller and runs a small
command inside the enqueue call. The slot then shows the callback's last store, and the run is
over: no segment, no flush, no tidy (:meth:`LeanEnqueue._done_at_once`; a failure, or a
completion that takes a clock sample, goes the usual way).

This is a mixin of :class:`~hcqa.devices.opencl.executor.ClExecutor`, which sets the
attributes declared below.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hcqa import commands as cmd
from hcqa.actors import engine as _engine
from hcqa.devices.opencl import runtime
from hcqa.devices.opencl.completion import Segment
from hcqa.devices.opencl.runtime import (
    DONE,
    FIRED,
    NSTORES,
    STATUS,
    STORES,
    TL2_FN,
    TL_ARG,
    TL_FN,
    TL_SEQ,
    WAKE,
)

__all__ = ["LeanEnqueue"]

_EXEC, _COPY, _SIGNAL, _STEP = cmd.Exec, cmd.Copy, cmd.Signal, cmd.Step


class LeanEnqueue:
    """The lean enqueue of a lone launch or copy (see the module doc)."""

    device: runtime.ClHost
    queue: Any
    timeline: Any
    error: BaseException | None
    pending: deque[Segment]
    backlog: deque[list[Any]]
    completed: int
    _native: Any
    _own: Any
    _launch: Any
    _on_fault: Callable[[Any, BaseException], None]

    if TYPE_CHECKING:  # the executor's methods this uses

        def _record(self, c: Any) -> Any: ...
        def _copy(self, dest: Any, src: Any, n: int, keep: list[Any], wait_for: Any) -> Any: ...
        def _foreign_step(self, book: tuple[Any, ...], words: Any) -> tuple[Any, int] | None: ...
        def _skip(self, commands: list[Any], error: BaseException | None) -> None: ...

    def _lean(self, run: list[Any]) -> bool:
        """The common run -- one launch or copy, this queue's signal, this device's step (and
        a transfer's step on the other device) -- enqueued with the least Python after the
        driver call; False (nothing done) for any other run, which ``_enqueue_run`` takes.
        With fast wake-ups the driver's worker runs the command inside the driver call and the
        loop's thread resumes with cold caches: the segment's slot is filled first, so only the
        segment, the callback's registration, a flush and the tidy follow it."""
        c = run[0]
        kind = type(c)
        n = len(run)
        if n < 3 or (kind is not _EXEC and kind is not _COPY) or _engine.trace_hook is not None:
            return False
        sig, step = run[1], run[2]
        timeline = self.timeline
        tl_fn = self._native.tl_complete
        if (
            type(sig) is not _SIGNAL
            or sig.signal is not self._own
            or type(step) is not _STEP
            or step.timeline is not timeline
            or not tl_fn
            or timeline.c_address is None
            or self.error is not None
        ):
            return False
        foreign: tuple[Any, int] | None = None
        last = run[3] if n == 4 else None
        if last is not None and (type(last) is not _STEP or last.timeline.c_address is None):
            return False
        words, address = self.device._slots.take()
        own = sig.signal
        words[STORES] = own.address
        value: int = sig.value  # type: ignore[assignment]  # resolved at submit
        words[STORES + 1] = value
        words[STORES + 2] = own.fd
        words[NSTORES] = 1
        words[TL_FN] = tl_fn
        words[TL_ARG] = timeline.c_address
        words[TL_SEQ] = step.seq
        if last is not None:
            foreign = self._foreign_step(("step", last.timeline, last.seq), words)
            if foreign is None:  # the pump completes it
                words[NSTORES] = 0
                words[TL_FN] = 0
                self.device._slots.give(words, address)
                return False
        keep: list[Any] = [run]
        try:
            if kind is _EXEC:
                rec = c.native
                if rec is None:
                    rec = self._record(c)
                elif rec[3] is not c.program.cl_args:
                    c.program.set_args(rec[3])
                event = self._launch(self.queue, rec[0], rec[1], rec[2])
            else:
                event = self._copy(c.dest, c.src, c.nbytes, keep, None)
        except BaseException as exc:
            if foreign is not None:  # the other device's step: completed by the skip below
                foreign[0].give_back_foreign(foreign[1])
            words[NSTORES] = words[TL_FN] = words[TL2_FN] = 0
            self.device._slots.give(words, address)
            self._on_fault(c, exc)
            self._skip(run[1:], self.error)
            self.queue.flush()
            return True
        keep.append(event)
        pending = self.pending
        status: int | None = None
        if not self.backlog:  # all done by the callback: the pump may find it later
            words[WAKE] = 0
            if not pending:
                # Alone in the driver (the common case): registered before a segment is
                # listed, since the driver runs the callback at once, on this thread, when
                # the command already completed (on a pinned host its worker ran it inside
                # the call). Then nothing is left to do.
                status = self._native.register(event, address)
                if status == 0 and self._done_at_once(words, address):
                    return True
        seg = Segment(event, [], keep, c)
        seg.own = value
        seg.words, seg.address, seg.foreign = words, address, foreign
        pending.append(seg)
        if status is None:
            status = self._native.register(event, address)
        if status != 0:
            raise RuntimeError(f"clSetEventCallback failed with OpenCL status {status}")
        self.queue.flush()
        self.device._tidy(self)
        return True

    def _done_at_once(self, words: Any, address: int) -> bool:
        """A lean segment whose callback already ran to its end, successfully, and that takes
        no clock sample: count it completed and give its slot back (its event and host objects
        go with the caller's frame: the command is complete, so a flush has nothing to send
        and dropping them can't block). False: list it as usual (the pump or the next tidy
        processes it, a driver failure included)."""
        if not (words[DONE] and words[FIRED]) or words[STATUS]:
            return False
        if not self.device._unsampled():
            return False
        self.completed += 1
        self.device._slots.give(words, address)
        return True
