"""Runs of OpenCL launches as one native call: the fusion seam on an OpenCL device.

Theory of operation
-------------------
A queue submitted again, or a graph replayed, sends the same launches each time; enqueueing
each from Python (its launch record, a PyOpenCL call, its event kept as a Python object and
released one by one later) costs more per kernel than the driver's own enqueue. Through the
fusion seam (``OpenCLDevice._fusable`` / ``_fuse``, :mod:`hcqa.devices.fusion`) each run of
two or more launches whose arguments and geometry are plain ints becomes a :class:`ClRun`:
a table the C function ``hcqa_cl_run`` (``runs.c``) walks, calling the driver's
``clSetKernelArg`` for the arguments that differ from the kernel's previous launch in the run
and ``clEnqueueNDRangeKernel`` per launch -- the first one with the wait list of the
driver-kept waits before it -- then ``clFlush``. Each launch's event goes into a
:class:`RunEvents` array the segment keeps until it completed (PoCL 3 touches the events
of commands behind a failed one), released by one native call (``hcqa_cl_release``) when
the segment is dropped. The last event (and the first, where a ``Timestamp`` before the run
takes its START) becomes a PyOpenCL event, which the segment's completion and its callback
use as for any command. While a tracer records, the executor enqueues a run's launches one by
one instead (a device range each).

The first launch of each kernel in the run takes the arguments of its table from Python
(``ClProgram.set_args``, which sets those that differ from the kernel's); after the run each
kernel's arguments are known to be its last launch's (``ClProgram.cl_args``). A launch whose
vals hold Variables is not fused: its launch record is patched in place (``program.Patched``).

Everything a launch is checked for -- geometry, arity, ranges, views -- was checked when its
``Exec`` was made, before anything was queued; the table holds OpenCL handles of memory the
run's commands keep alive (``ClRun.execs``), and a queue checks at each submit that none of
its buffers was freed. ``runs.c`` is compiled into the library of the completion callback
(``runtime.py``), which an OpenCL device can't open without.

One CPU (``one_cpu``: the process's affinity is one CPU): each launch that finds the queue
idle would wake PoCL's worker, which then takes the CPU from the enqueueing thread (two
context switches per launch). The run's first launch then also waits for a user event (the
*gate*) that ``hcqa_cl_run`` completes once every launch is enqueued -- after a refusal too,
so what was enqueued runs as it would without one. With several CPUs the worker runs the
first launches while the rest are enqueued, and there is no gate.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

import attrs

from hcqa import commands as cmd
from hcqa.devices.buffer import Buffer
from hcqa.devices.fusion import FusedRun, access_of
from hcqa.devices.opencl.program import ClProgram, Patched

__all__ = ["ClRun", "NativeRuns", "RunEvents", "fusable", "make_run", "one_cpu"]

_MEM_SIZE = ctypes.sizeof(ctypes.c_void_p)  # sizeof(cl_mem)


class RunEvents:
    """The events of one enqueue of a run (``n`` words, then two status words), released by
    one native call when the segment holding it is dropped -- never, when that segment is
    kept for good (a command the driver failed, whose events PoCL may still touch)."""

    __slots__ = ("address", "n", "release", "words")

    def __init__(self, n: int, release: Any) -> None:
        self.words = (ctypes.c_uint64 * (n + 2))()
        self.address = ctypes.addressof(self.words)
        self.n = n
        self.release = release

    def __del__(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            try:
                release(self.address, self.n)
            except Exception:  # (interpreter exit: ctypes may be gone; the process ends)
                pass


@attrs.frozen(eq=False)
class ClRun(FusedRun):
    """Launches enqueued by one native call (see the module doc)."""

    execs: tuple[cmd.Exec, ...] = attrs.field(repr=False)
    names: tuple[str, ...]
    table: Any = attrs.field(repr=False)  # ctypes uint64 array (``runs.c``)
    address: int = attrs.field(repr=False)
    # per program: the arguments of its first launch in the run (set from Python before
    # the call) and of its last (the kernel's arguments after it)
    firsts: tuple[tuple[ClProgram, Any], ...] = attrs.field(repr=False)
    lasts: tuple[tuple[ClProgram, Any], ...] = attrs.field(repr=False)
    symbols: tuple[Any, ...] = attrs.field(default=(), repr=False)
    reads_writes: Any = attrs.field(default=None, repr=False)  # ``access``, made once

    def access(self) -> tuple[tuple[Buffer, ...], tuple[Buffer, ...]]:
        if self.reads_writes is None:
            object.__setattr__(self, "reads_writes", access_of(self.execs))
        return self.reads_writes  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self.execs)

    def buffers(self) -> tuple[Buffer, ...]:
        seen: dict[Buffer, None] = {}
        for e in self.execs:
            for b in e.buffers:
                seen[b] = None  # type: ignore[index]
        return tuple(seen)

    def bound(
        self, values: Mapping[Any, int] | None, rebind: Mapping[Buffer, Buffer] | None
    ) -> ClRun:
        """The same launches on the buffers of ``rebind`` (no symbols: nothing to fill)."""
        if not rebind:
            return self
        execs = []
        for e in self.execs:
            bufs = tuple(rebind.get(b, b) for b in e.buffers)  # type: ignore[call-overload]
            cast("ClProgram", e.program).check_buffers(bufs)  # a view it can't take: refused
            execs.append(attrs.evolve(e, buffers=bufs))
        return make_run(execs)


def fusable(exec_: cmd.Exec) -> bool:
    """An OpenCL launch whose vals and sizes are all plain ints."""
    if not isinstance(exec_.program, ClProgram):
        return False
    return all(type(v) is int for v in (*exec_.vals, *exec_.global_size, *exec_.local_size))


def make_run(execs: Sequence[cmd.Exec]) -> ClRun:
    """The table of ``execs`` (each :func:`fusable`): per launch its kernel, NDRange, local
    size and the arguments that differ from its kernel's previous launch in the run."""
    words: list[int] = []
    firsts: dict[ClProgram, Any] = {}
    lasts: dict[ClProgram, Any] = {}
    encoded: dict[ClProgram, list[tuple[int, int]]] = {}
    for e in execs:
        prog: ClProgram = e.program  # type: ignore[assignment]
        rec = e.native if e.native is not None else prog.record(e)
        args = rec[3]
        if isinstance(args, Patched):  # (fusable() refused these: defensive)
            raise TypeError("a launch with variables can't be fused on OpenCL")
        enc = _encode(prog, args)
        words.append(int(rec[0].int_ptr))
        words.append(3)
        words.extend(rec[1])
        words.extend(rec[2])
        before = encoded.get(prog)
        if before is None:  # the caller sets the first launch's arguments
            firsts[prog] = args
            changed: list[int] = []
        else:
            if args == lasts[prog]:
                args = lasts[prog]  # one tuple for equal arguments (identity is checked)
            changed = [i for i, (a, b) in enumerate(zip(enc, before, strict=True)) if a != b]
        words.append(len(changed))
        for i in changed:
            words.extend((i, enc[i][0], enc[i][1]))
        encoded[prog] = enc
        lasts[prog] = args
    table = (ctypes.c_uint64 * len(words))(*words)
    return ClRun(
        tuple(execs),
        tuple(e.program.name for e in execs),
        table,
        ctypes.addressof(table),
        tuple(firsts.items()),
        tuple(lasts.items()),
    )


def _encode(prog: ClProgram, args: tuple[Any, ...]) -> list[tuple[int, int]]:
    """(size, value) per argument, as ``clSetKernelArg`` takes it."""
    types = prog._types
    base = len(args) - len(types)
    out: list[tuple[int, int]] = []
    for i, a in enumerate(args):
        if i < base:
            out.append((_MEM_SIZE, int(a.int_ptr)))
        else:
            size = types[i - base]().itemsize
            out.append((size, int(a) & ((1 << (8 * size)) - 1)))
    return out


class NativeRuns:
    """A queue's launches: from launch records (``_record``), and runs enqueued by one
    native call (``_run``). A mixin of
    :class:`~hcqa.devices.opencl.executor.ClExecutor`, which sets the attributes below."""

    queue: Any
    _cl: Any
    _native: Any
    _gate_context: int  # the context of the gate's user event (0: no gate; ``one_cpu``)
    _bound: list[Any]  # the values of the latest Bind (``program.Patched``)

    def _run(
        self, run: ClRun, keep: list[Any], wait_for: list[Any] | None, head: bool
    ) -> tuple[Any, Any]:
        """Enqueue ``run``'s launches by one native call (``runs.py``); (its first event when
        ``head``, else None; its last event), as PyOpenCL events. ``keep`` gets them all."""
        for prog, args in run.firsts:  # the kernels' arguments at their first launch
            if prog.cl_args is not args:
                prog.set_args(args)
        n = len(run.execs)
        events = RunEvents(n, self._native.release)
        keep.append(events)
        nwait, wait = 0, 0
        if wait_for:
            nwait = len(wait_for)
            waits = (ctypes.c_uint64 * nwait)(*[e.int_ptr for e in wait_for])
            wait = ctypes.addressof(waits)
        words = events.words
        done = self._native.run(
            self.queue.int_ptr, run.address, n, nwait, wait, events.address,
            events.address + 8 * n, 0, self._gate_context,
        )  # fmt: skip
        if done != n:
            for prog, _ in run.lasts:  # unknown now: set every argument next time
                prog.cl_args = ()
            events.n = done
            raise self._cl.Error(
                f"{run.names[done]!r}: the OpenCL driver refused the launch "
                f"(clSetKernelArg / clEnqueueNDRangeKernel status {ctypes.c_int64(words[n]).value})"
            )
        for prog, args in run.lasts:
            prog.cl_args = args
        wrap = self._cl.Event.from_int_ptr
        last = wrap(words[n - 1], retain=True)
        return (wrap(words[0], retain=True) if head else None), last

    def _record(self, c: Any) -> Any:
        """``c``'s launch record (made at its first launch), its arguments set on the kernel."""
        rec = c.native
        if rec is None:
            rec = c.program.record(c)
            if type(rec[3]) is Patched:  # its variables: from this queue's latest Bind
                rec[3].cell = self._bound
            object.__setattr__(c, "native", rec)
        if rec[3] is not c.program.cl_args:
            c.program.set_args(rec[3])
        return rec


def one_cpu() -> bool:
    """Whether this process may run on one CPU only (``taskset -c 0``, a 1-vCPU host)."""
    try:
        return len(os.sched_getaffinity(0)) == 1
    except (AttributeError, OSError):  # (no affinity on this platform: assume several)
        return (os.cpu_count() or 1) == 1
