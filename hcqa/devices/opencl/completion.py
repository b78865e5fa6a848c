"""How a segment of an OpenCL queue completes: in the driver's callback, or on the pump.

Theory of operation
-------------------
A :class:`Segment` is the driver commands of a run up to one event and the bookkeeping to do
once that event completed (``executor.py`` closes it). Where nothing Python must do comes
first, the native callback does it itself (``_native_stores``, shared with every driver
backend in ``hcqa/devices/nativestores.py``): this queue's own signal, this device's
timeline step through its C timeline, and a transfer's last step on the other device's C
timeline (``_foreign_step``) -- their waiters wake straight from the driver's
thread. What is left (timestamps from the profiling counters, other signals, the Python
timeline's bookkeeping, trace ranges) the device's pump does on the loop (``complete``);
a segment the driver failed breaks its signals instead (``fail``).

This is a mixin of :class:`~hcqa.devices.opencl.executor.ClExecutor`, which sets the
attributes declared below.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from hcqa import commands as cmd
from hcqa.actors import engine as _engine
from hcqa.devices.nativestores import NativeStores
from hcqa.devices.opencl import runtime, waits
from hcqa.errors import DeviceFault

if TYPE_CHECKING:
    from hcqa.devices.opencl.waits import Gate

__all__ = ["Completion", "Segment", "describe"]


class Segment:
    """Driver commands up to ``event`` and the work to do once it completed."""

    __slots__ = (
        "address", "books", "event", "flows", "foreign", "gates", "keep", "own", "served",
        "traced", "what", "words",
    )  # fmt: skip

    def __init__(self, event: Any, books: list[tuple[Any, ...]], keep: list[Any], what: Any):
        self.traced: list[tuple[Any, Any]] | None = None  # (command, event) while tracing
        self.flows: Any = None  # a tracer's flow sources into this segment's first range
        self.served: Any = None  # (fed, tag): the served request or batch that sent it
        self.event = event
        # ("stamp", signal, event or None, start?) / ("signal", signal, value) / ("step", tl, seq)
        self.books = books
        self.keep = keep  # commands and host objects the driver may still touch
        self.what = what  # a description, or the command to describe if it fails
        self.words: Any = None
        self.address = 0
        self.foreign: tuple[Any, int] | None = None  # (timeline, seq) the callback completes
        self.own = 0  # the value it sets its queue's signal to (0: none): what Gates look for
        self.gates: list[Gate] | None = None  # waits the driver kept for its commands


class Completion(NativeStores):
    """A queue's segments completed: natively, or by the pump (see the module doc)."""

    device: runtime.ClHost
    kind: str
    timeline: Any
    completed: int
    _native: Any
    _ordered: int

    def complete(self, seg: Segment) -> None:
        """Do a fired segment's work, in order."""
        status = ctypes.c_int64(seg.words[runtime.STATUS]).value
        if status < 0:  # drivers that report failures through the callback (PoCL >= 7)
            self.fail(seg, status)
            return
        if seg.traced is not None:
            self._trace(seg)
        offset: int | None = None
        for book in seg.books:
            op = book[0]
            if op == "signal":
                book[1]._set_from_engine(book[2])
            elif op == "step":
                book[1].complete(book[2])
            else:  # Signal.timestamp is on the host clock: one offset for the whole segment
                if offset is None:
                    offset = self.device.clock_offset_ns()
                ev = book[2] if book[2] is not None else seg.event
                ns = ev.profile.start if book[3] else ev.profile.end
                book[1]._stamp_from_engine(ns + offset)
        self.completed += 1

    def _trace(self, seg: Segment) -> None:
        """Device ranges of a traced segment, from its events' profiling counters moved to
        the host clock, and the producers of the signals it sets (for flow arrows)."""
        hook = _engine.trace_hook
        if hook is None:
            return
        offset = self.device.clock_offset_ns()
        flows = seg.flows
        if seg.gates:  # waits the driver kept: arrows from their producers' last ranges
            flows = [*(flows or ()), *waits.sources(hook, seg.gates)]
        traced = seg.traced or ()
        ranges = [(c, ev.profile.start + offset, ev.profile.end + offset) for c, ev in traced]
        track = hook._driver_ranges(self, flows, seg.served, ranges)
        for book in seg.books:
            if book[0] == "signal" and track.last is not None:
                hook._produced_by(book[1], book[2], track.last)

    def fail(self, seg: Segment, status: int, *, called_back: bool = True) -> None:
        """The driver failed ``seg``'s commands: fault the device, skip the bookkeeping
        (``called_back``: False when its callback never ran and never will). A segment that
        waited in the driver for another queue failed because a producer did, when one did:
        its fault is then the producer's, the very instance (``waits.producers_fault``)."""
        fault = waits.producers_fault(self, seg.gates)  # type: ignore[arg-type]
        if fault is None:
            fault = DeviceFault(
                f"{self.device.name}: {describe(seg.what)} failed on the {self.kind} queue: "
                f"the OpenCL driver reported execution status {status} for it",
                device=self.device.name,
                queue=self.kind,
            )
        self.device._fault(fault)
        for book in seg.books:
            if book[0] == "signal":
                book[1]._break(self.device._error)
            elif book[0] == "step" and book[1] is not self.timeline:
                book[1].complete(book[2])
        if seg.foreign is not None and not called_back:  # the other device may close
            tl, seq = seg.foreign
            tl._native.tl_complete(tl.c_address, seq, 1)


def describe(c: Any) -> str:
    """What a failed segment's commands are, for its fault (a description passes as is)."""
    if type(c) is str:
        return c
    if type(c) is cmd.Exec:
        return f"program {c.program.name!r}"
    if type(c) is cmd.Copy:
        return f"copy of {c.nbytes} bytes"
    if type(c) is cmd.Load:
        return f"load of {c.path!r}"
    return f"native run of {', '.join(map(repr, c.names))}"
