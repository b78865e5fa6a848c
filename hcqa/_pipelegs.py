"""Legs: a Pipeline call as one batch per device (``hcqa/pipeline.py``).

Theory of operation
-------------------
Between two steps of a call on the *same* queue there is nothing to wait for: the queue keeps
their order. So a *leg* is one batch on one device's compute queue that holds, in order:

* on the first device, the copy of the caller's array into the slot's input;
* the stage's launch, and the next stages' launches while they run on the same device;
* then the transfer to the next stage's device, run right behind the kernel that wrote its
  source (a ``Copy`` on a cpu compute queue: a ``memmove`` between host memories); or, on
  the last device, the copy-out into the caller's result array.

One ``Device._submit`` and one fence per device instead of one per copy, launch and
transfer. A call sends its legs at once (the next leg's wait on the one before is gated by
the host: the cpu backend keeps no device-side waits), so a microbatch crosses each device
boundary with one hand-off through the event loop, where a transfer on the copy queue takes
two (kernel -> copy engine -> next kernel). An asyncio caller's lone call runs *step by
step* instead (see the pipeline's module doc): each leg is enqueued on the loop once the
leg before it is reached, so it finds its hazards done and goes straight to an idle engine,
with no trio task woken.

Copies that open a leg ahead of a Python kernel are marked for the engine's Python thread
(``lane.PYTHON``): on a native lane's thread they would run first and then hand over to
Python, two thread wake-ups where the engine's Python thread alone takes one.

Legs are planned from the slot's steps (the graph's enqueues, recorded when the slot was
built) when every step is a plain program launch with int vals and sizes, or a transfer,
between devices whose memory is host memory and whose compute queue takes host copies
(``Device._copies_on_compute``: cpu devices with host-visible memory); else (a Graph stage,
OpenCL, a staged device) the call replays the slot's graph (step by step: enqueues its steps
one by one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy.typing as npt

from hcqa import commands as cmd
from hcqa.actors.lane import PYTHON
from hcqa.devices.base import Device
from hcqa.devices.buffer import Buffer
from hcqa.devices.hostarrays import host_ref
from hcqa.devices.opening import transfer
from hcqa.devices.program import Program
from hcqa.signals import Fence

__all__ = ["Leg", "plan_legs", "reached"]

_copy_command = cmd.maker(cmd.Copy)  # (dest, src, nbytes, native)


def reached(fence: Fence) -> bool:
    """The fence is reached and no batch of its signal failed (awaiting it would raise):
    a step by step call goes on without a trip round the event loop."""
    sig = fence.signal
    return sig.value >= fence.value and not sig._failed


class Leg:
    """One device's part of a call (see the module doc)."""

    __slots__ = ("also", "buffers", "commands", "device", "ended", "inp", "out", "reads", "writes")

    def __init__(self, device: Device) -> None:
        self.device = device
        self.commands: list[Any] = []  # launches and the transfer: the same every call
        self.reads: list[Buffer] = []
        self.writes: list[Buffer] = []
        self.also: tuple[Device, ...] = ()  # devices whose memory the transfer touches
        self.buffers: list[Buffer] = []  # checked before each submit (freed, closed)
        self.ended = False  # a transfer ends a leg: the next stage is on another device
        self.inp: Buffer | None = None  # the first leg copies the caller's array in here
        self.out: Buffer | None = None  # the last leg copies this out

    def submit(self, arr: npt.NDArray[Any], result: npt.NDArray[Any]) -> Fence:
        """Enqueue the leg on its device's compute queue -- the first leg copying ``arr``
        in, the last one copying out into ``result`` -- and return the batch's Fence."""
        for b in self.buffers:
            b._check()
        commands = list(self.commands)
        reads, writes = self.reads, self.writes
        if self.inp is not None:
            inp = self.inp
            first = self.commands[0]  # (a launch)
            native = PYTHON if first.program.kernel is None else None
            copy = _copy_command(inp, host_ref(arr, inp, writable=False), inp.nbytes, native)
            commands.insert(0, copy)
            writes = [inp, *writes]
        if self.out is not None:
            out = self.out
            host = host_ref(result, out, writable=True)
            commands.append(_copy_command(host, out, out.nbytes, None))
            reads = [*reads, out]
        device = self.device
        return device._submit(
            device.compute, commands, reads=reads, writes=writes, also=self.also, waits=False
        )


def _host_copies(device: Device) -> bool:
    return device.host_memory and device._copies_on_compute()


def _int_sizes(exec_: cmd.Exec) -> bool:
    return all(type(v) is int for v in (*exec_.vals, *exec_.global_size, *exec_.local_size))


def plan_legs(steps: Sequence[Callable[[], Fence]], inp: Buffer, out: Buffer) -> list[Leg] | None:
    """The legs of a slot whose ``steps`` allow them (see the module doc), its input
    ``inp`` copied in by the first and its output ``out`` copied out by the last; else
    None."""
    legs: list[Leg] = []
    for step in steps:
        if not isinstance(step, functools.partial):
            return None
        fn, args, kw = step.func, step.args, step.keywords
        if fn is transfer:
            dest, src = args
            if not legs or legs[-1].ended or legs[-1].device is not src.device:
                return None
            if not dest.device.host_memory:
                return None
            leg = legs[-1]
            leg.commands.append(_copy_command(dest, src, dest.nbytes, None))
            leg.reads.append(src)
            leg.writes.append(dest)
            leg.buffers += (src, dest)
            if dest.device is not leg.device:
                leg.also = (*leg.also, dest.device)
            leg.ended = True
            continue
        if not isinstance(fn, Program):
            return None
        device = fn.device
        if not isinstance(device, Device) or not _host_copies(device):
            return None
        bufs = tuple(args)
        exec_ = fn.validate(bufs, kw["vals"], kw["global_size"], kw["local_size"])
        if not _int_sizes(exec_):
            return None  # Variables: resolved per submit by the launch path
        if legs and not legs[-1].ended:
            if legs[-1].device is not device:
                return None  # (a stage on another device comes after a transfer)
            leg = legs[-1]
        else:
            leg = Leg(device)
            legs.append(leg)
        writes, reads = fn.access(len(bufs))
        leg.commands.append(exec_)
        leg.reads += [bufs[i] for i in reads]
        leg.writes += [bufs[i] for i in writes]
        leg.buffers += bufs
    if not legs or legs[-1].ended or inp.device is not legs[0].device:
        return None
    if out.device is not legs[-1].device:
        return None
    legs[0].inp, legs[-1].out = inp, out
    return legs
