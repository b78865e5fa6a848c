"""Timing a stretch of queue work with device timestamps (the model's ``hcq_profile``).

Theory of operation
-------------------
``async with device.timed() as span:`` enqueues, at entry, a ``Timestamp`` into a start
signal on the device's compute queue (or the queue named by ``queue=``): the device
writes it when that queue reaches this point, after the work queued on it before. At
exit it enqueues, on the same queue, a ``Wait`` for everything queued so far on the
device's other queue and a ``Timestamp`` into an end signal, then awaits it. So the
span covers the work the block queued on either queue of the device, timed by the
device, not by the host's view of it; ``span.seconds`` is the difference.

Device clocks: ``Signal.timestamp`` is on the host clock (``time.monotonic_ns``) for every
device. A device with a clock of its own reads its counters and adds
:meth:`~hcqa.devices.base.Device.clock_offset_ns` when it stores a timestamp (the OpenCL
device: profiling counters plus its measured offset, one offset per completion, so the two
ends of a kernel's time share it); the cpu device's engines stamp with the host clock
itself. So ``seconds`` is a difference of device times, and ``start_us`` / ``end_us``
(microseconds) sit on the host clock.

If the block raises, or the wait at exit is cancelled, the span has no result
(``seconds`` stays None); the queued timestamps still run, and keep their signals
alive until they have.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from hcqa import aio
from hcqa import commands as cmd
from hcqa.devices.capture import current_capture
from hcqa.errors import InvalidCommand
from hcqa.signals import Signal

if TYPE_CHECKING:
    from hcqa.devices.buffer import DeviceRef

__all__ = ["TimedSpan"]


class TimedSpan:
    """``async with device.timed() as span: ...`` then ``span.seconds``."""

    def __init__(self, device: DeviceRef, queue: str) -> None:
        if queue not in ("compute", "copy"):
            raise InvalidCommand(f"'queue' must be 'compute' or 'copy' (got {queue!r})")
        self.device = device
        self.queue = queue
        self.seconds: float | None = None
        self.start_us: float | None = None  # host clock (as Signal.timestamp), µs
        self.end_us: float | None = None
        self._start: Signal | None = None

    async def __aenter__(self) -> TimedSpan:
        if current_capture() is not None:
            raise InvalidCommand("device.timed() can't be captured: time the graph's replay")
        if self._start is not None:
            raise InvalidCommand("a TimedSpan can be entered once (make a new one per span)")
        d = self.device
        d._check_usable()
        start = Signal(name=f"{d.name} span start")
        try:
            d._submit(d._queues[self.queue], [cmd.Timestamp(signal=start)], waits=False)
        except BaseException:
            start.close()
            raise
        self._start = start
        await aio.checkpoint()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            return  # no result; the queued timestamp keeps its signal alive until it runs
        d = self.device
        assert self._start is not None
        actor = d._queues[self.queue]
        other = d._queues["copy" if self.queue == "compute" else "compute"]
        end = Signal(name=f"{d.name} span end")
        commands: list[object] = [cmd.Timestamp(signal=end)]
        if other.signal.value < other.value:  # the other queue's work so far, too
            commands.insert(0, cmd.Wait(signal=other.signal, value=other.value))
        fence = d._submit(actor, commands, waits=len(commands) > 1)
        await fence
        first, last = self._start._stamp.value, end._stamp.value
        self.seconds = (last - first) / 1e9
        self.start_us = first / 1000.0  # stamps are on the host clock (see the module doc)
        self.end_us = last / 1000.0
        self._start.close()
        end.close()

    def __repr__(self) -> str:
        got = "pending" if self.seconds is None else f"{self.seconds:.6f} s"
        return f"<TimedSpan {self.device.name} {self.queue}: {got}>"
