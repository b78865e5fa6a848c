"""Waits the OpenCL driver keeps: a cross-queue Wait as an event wait list, not a host gate.

Theory of operation
-------------------
A queue actor asks its device before it awaits a ``Wait(signal, value)`` on the host
(``Device._driver_wait``, the seam's fast path). On OpenCL the answer is :func:`hold`: when
``signal`` is the queue signal of an OpenCL queue of the same context -- this device's other
queue, or a queue of another hcqa device on the same platform (one context per platform,
``runtime.context_for``) -- and the command that sets it to ``value`` or beyond is already
enqueued, the producer's segment is known (the first pending one whose ``own`` value reaches
``value``; values grow along the deque), and a :class:`Gate` holding its event replaces the
Wait in the run. The executor puts the event in the wait list of the next driver command it
enqueues (a marker's, when a ``Signal``, ``Step`` or ``Timestamp`` comes first), so the driver
starts what follows once the producer completed, with no trip through the host.

Everything else the host still gates (:func:`hold` says None): a producer not yet enqueued
(behind a host wait of its own), signals the host sets, other processes' signals, cpu
devices' queues, another platform's context, a producer whose device faulted or is closing.
Semantics are the host wait's: ``>=`` on the 64-bit value, and the producer's queue signal
only grows. The event the gate holds is kept by the waiting segment; the driver retains it
too.

Faults cross as on the host: a producer that fails in the driver makes the driver fail the
commands waiting on it; when the waiter's failure is found (the callback's status on a later
PoCL, the hang check on PoCL 3) :func:`producers_fault` has the producer's device look for
its own failure first and returns that device's sticky error, which the waiter takes: the
very instance, as a broken signal gives a host waiter. A producer that never completes
leaves the waiter's fences to the hang limit, as a host wait would.

Traces: a waiting segment draws flow arrows from its producers' last device ranges
(:func:`sources`), since no host wait announced them.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

from hcqa.devices.opencl import runtime
from hcqa.signals import Signal

__all__ = ["Gate", "Queue", "hold", "producers_fault", "sources", "wait_list"]


class Queue(Protocol):
    """What a Gate uses of an OpenCL queue's executor (``executor.py``; named here by this
    protocol, as the executor imports this module)."""

    device: runtime.ClHost
    error: BaseException | None
    pending: collections.deque[Any]  # its Segments (``completion.py``), oldest first


class Gate:
    """A Wait the driver keeps: the commands after it wait for ``segment`` of the
    ``producer`` queue, whose ``event`` completes once its queue signal reached ``value`` or
    more (``event`` None: the producer is the waiting queue itself, in order already)."""

    __slots__ = ("event", "producer", "segment", "signal", "value")

    def __init__(
        self, event: Any, producer: Queue, segment: Any, signal: Signal, value: int
    ) -> None:
        self.event = event
        self.producer = producer
        self.segment = segment
        self.signal = signal
        self.value = value


def hold(waiter: Queue, signal: Signal, value: int) -> Gate | None:
    """A :class:`Gate` for ``Wait(signal, value)`` on ``waiter``'s queue when the driver can
    keep it (see the module doc); None: the host must gate it."""
    producer: Queue | None = runtime.producers.get(signal)
    if producer is None or waiter.error is not None or producer.error is not None:
        return None
    if producer.device.context is not waiter.device.context or producer.device._error:
        return None
    pending = producer.pending
    found: Any = None
    i = len(pending) - 1
    while i >= 0:  # values grow left to right: the last few are the likely ones
        try:
            seg = pending[i]
        except IndexError:  # (the pump shrinks it on this thread only; be safe anyway)
            break
        own = seg.own
        if own:
            if own < value:
                break
            found = seg
        i -= 1
    if found is None:  # not enqueued yet: the host gates
        return None
    return Gate(None if producer is waiter else found.event, producer, found, signal, value)


def wait_list(gates: list[Gate]) -> list[Any] | None:
    """The events a command after ``gates`` waits for (None: none)."""
    return [g.event for g in gates if g.event is not None] or None


def producers_fault(waiter: Queue, gates: list[Gate] | None) -> BaseException | None:
    """The fault of a producer the failed segment waited for in the driver (its device's
    sticky error, once that device looked for failures among its pending commands), or
    None when none of them failed."""
    for gate in gates or ():
        producer = gate.producer
        if producer is waiter:
            continue
        owner = producer.device
        if owner._error is None:
            owner._check_failed([producer])  # a failure found here faults the producer
        if owner._error is not None:
            return owner._error
    return None


def sources(hook: Any, gates: list[Gate]) -> list[tuple[int, int, int, int]]:
    """Flow sources (pid, tid, start, end on the host clock) of ``gates``' producers: the
    range their producing segment's last command drew (or will draw) in the trace."""
    out = []
    for gate in gates:
        traced = gate.segment.traced
        if not traced or gate.event is None:  # untraced, or this queue's own (no arrow)
            continue
        try:
            profile = traced[-1][1].profile
            offset = gate.producer.device.clock_offset_ns()
            t0, t1 = int(profile.start) + offset, int(profile.end) + offset
        except Exception:  # a failed producer has no times: no arrow
            continue
        track = hook._engines.get(gate.producer) or hook._track(gate.producer)
        out.append((track.pid, track.tid, t0, t1))
    return out
