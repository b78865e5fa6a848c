"""The ``cpu:N`` device: host memory, and kernels that really compute.

Theory of operation
-------------------
A cpu device's "hardware" is its two engine threads. The compute engine runs
programs: a Python callable gets numpy views of its buffers and the int vals;
a C kernel (compiled once by the system compiler, see ``hcqa/_native/compiler.py``) gets
the buffers' addresses and the int vals through ctypes. Both release the GIL
for the heavy part (numpy, ctypes), so two cpu devices compute in parallel and
the event loop keeps running.

The copy engine moves bytes with ``ctypes.memmove`` (GIL released) and reads
files with ``os.preadv`` straight into device memory. With
``host_visible=False`` the device pretends the host cannot address its memory,
as a discrete GPU's: host copies and file loads then go through the staging
ring (4 x 2 MiB) in chunks, exactly the path a real device takes, while
device-to-device copies stay direct.

A direct copy of at most ``INLINE_COPY_MAX`` (1 MiB) bytes, alone in its batch, on
an idle copy queue with no hazard to wait for, runs inline on the caller's thread
(``_inline``): the fence is reached when the call returns. It is bounded: a
``memmove`` of 1 MiB between resident pages takes tens of microseconds, about what the
copy engine's two thread wake-ups would cost. A host array that maps a file
(``np.memmap``, an ``mmap``) is copied by the engine: its page faults may wait for the
disk. A kernel never runs on the caller's thread unless the device was opened with
``inline_kernels=True``; then a C kernel's repeat call does once it was measured short
(``launch._Launch``): at most 20 us in each of three calls in a row.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hcqa import commands as cmd
from hcqa._native.compiler import compile_c
from hcqa._native.lane import OP_CALL, OP_COPY, REC, library
from hcqa.actors import Executor
from hcqa.actors.engine import resolve_bound
from hcqa.actors.lane import Encoder, LaneEngine
from hcqa.devices.base import Device
from hcqa.devices.buffer import Buffer
from hcqa.devices.cpu.crunner import RunC, build_runner, entries, generic_entry, trampoline, wrap64
from hcqa.devices.cpu.staging import Drain
from hcqa.devices.fusion import access_of
from hcqa.devices.hostarrays import array_address
from hcqa.devices.memory import StagingRing
from hcqa.devices.program import Program, check_return
from hcqa.errors import InvalidCommand

__all__ = ["CpuDevice"]

_memmove = ctypes.memmove

INLINE_COPY_MAX = 1 << 20  # bytes: a direct copy this short may run on the caller's thread


def _maps_a_file(end: Any) -> bool:
    """Whether a copy's host end is (a view of) a file mapping: ``np.memmap``, ``mmap``."""
    if type(end) is not cmd.HostMemoryRef:
        return False
    keep = end.keep  # (what the caller passed, its array): see ``buffer.host_ref``
    obj = keep[0] if type(keep) is tuple and keep else keep
    for _ in range(8):  # a view's chain of bases
        if isinstance(obj, np.memmap | mmap.mmap):
            return True
        obj = obj.base if isinstance(obj, np.ndarray) else getattr(obj, "obj", None)
        if obj is None:
            return False
    return True  # a chain this long: don't guess


def _bytes_at(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


class CpuDevice(Device):
    """A device whose memory is host memory and whose engines are threads."""

    kind = "cpu"
    native_runner = True  # an engine calls an Exec's ready native call directly
    shares_native = True  # a lane record is the call's bytes: no memory held

    def __init__(self, name: str, **options: Any) -> None:
        self.staging = StagingRing(name=name)
        self._drain = Drain(name)  # the device side of staged copies (a thread, when used)
        super().__init__(name, **options)

    def _executor(self, kind: str) -> Executor:
        """With ``inline_kernels=False`` (and a C compiler), each queue's engine is a native
        lane (``hcqa/actors/lane.py``): C kernels, copies, signals, timestamps and timeline
        steps run on a thread of C, the rest on the engine's Python thread, in order."""
        lib = None if self.inline_kernels else library()
        if lib is None:
            return super()._executor(kind)
        return LaneEngine(
            f"{self.name} {kind}",
            self._handlers(kind),
            on_fault=lambda command, exc: self._on_engine_fault(kind, command, exc),
            native=True,
            encoders=self._encoders(kind),
            lib=lib,
        )

    def _encoders(self, kind: str) -> dict[type, Encoder]:
        if kind == "compute":
            return {cmd.Exec: _encode_exec, RunC: _encode_run, cmd.Copy: self._encode_copy}
        return {cmd.Copy: self._encode_copy}

    def _encode_copy(self, c: Any) -> tuple[bytes, None, None] | None:
        n = c.nbytes
        if type(n) is not int or self._staged(c.src) or self._staged(c.dest):
            return None
        return REC.pack(OP_COPY, c.dest.va_addr, c.src.va_addr, n, 0), None, None

    def _handlers(self, kind: str) -> dict[type, Callable[[Any], None]]:
        if kind == "compute":  # plain copies too: see _copies_on_compute
            return {cmd.Exec: self._exec, RunC: RunC.__call__, cmd.Copy: self._copy_plain}
        return {cmd.Copy: self._copy, cmd.Load: self._load_file}

    def _make_program(
        self,
        name: str,
        src: Any,
        **options: Any,
    ) -> Program:
        entry, writes, reads = options["entry"], options["writes"], options["reads"]
        geometry, flags = options.get("geometry", False), options.get("flags", ())
        if callable(src):
            if entry is not None:
                raise InvalidCommand("'entry' is for C source only (got a Python callable)")
            if flags:
                raise InvalidCommand(
                    f"'flags' is for C source only (got {flags!r} for a Python callable)"
                )
            return Program(self, name, fn=src, writes=writes, reads=reads, geometry=geometry)
        if isinstance(src, str):
            kernel = compile_c(src, entry if entry is not None else name, flags=("-O2", *flags))
            prog = Program(self, name, kernel=kernel, writes=writes, reads=reads, geometry=geometry)
            # What a launch would otherwise compile or load on the caller's thread: the
            # kernel's trampoline (a native lane's call, a generic runner's) and the generic
            # runner itself (a fused queue's first submit) -- here, in program_async's thread.
            prog.trampoline = trampoline(kernel)
            generic_entry()
            return prog
        raise InvalidCommand(
            f"program source must be a Python callable or C source str (got {type(src).__name__})"
        )

    def _fusable(self, exec_: cmd.Exec) -> bool:
        """A C kernel fuses, with variables too where the table can carry them (not a
        symbolic launch size for a kernel that does not receive its geometry)."""
        if exec_.program.kernel is None:
            return False
        return exec_.args is not None or entries(exec_) is not None

    def _fuse(self, run: Sequence[cmd.Exec]) -> RunC:
        """One native call over an argument table (``crunner.py``): the generic runner,
        each kernel through its trampoline, nothing compiled."""
        calls = [(e.program.kernel, entries(e)) for e in run]
        names = [e.program.name for e in run]
        return build_runner(calls, names, access_of(run))  # type: ignore[arg-type]

    def _inline(self, command: Any) -> bool:
        """Direct copies of up to ``INLINE_COPY_MAX`` bytes run on the caller's thread when
        the queue is idle: ``memmove`` of 1 MiB takes ~25-35 us, less than the two thread
        wake-ups the copy engine would cost (and no longer than the event loop may be held)
        -- unless a host end maps a file, whose page faults may wait for the disk. A C
        kernel's repeat calls once measured short (``launch._Launch``) only when the
        device was opened with ``inline_kernels=True``."""
        if type(command) is cmd.Exec:
            return command.inline and self.inline_kernels
        if type(command) is not cmd.Copy:
            return False
        n = command.nbytes
        src, dest = command.src, command.dest
        return (
            type(n) is int
            and n <= INLINE_COPY_MAX
            and not (self._staged(src) or self._staged(dest))
            and not (_maps_a_file(src) or _maps_a_file(dest))
        )

    # -- engine handlers (run in engine threads) ------------------------------------------

    @staticmethod
    def _exec(c: Any) -> None:
        prog: Program = c.program
        if prog.kernel is not None:
            prog.kernel.fn(*c.args)
        else:
            assert prog.fn is not None
            arrays = [b._kernel_array() for b in c.buffers]
            vals = c.vals
            for v in vals:
                if type(v) is not int:  # a graph replay patched them in place: see Bind
                    vals = resolve_bound(vals)
                    break
            if prog.geometry:  # the keyword-only sizes it declares, resolved
                sizes = {n: getattr(c, n) for n in prog.geometry}
                got = prog.fn(*arrays, *vals, **sizes)
            else:
                got = prog.fn(*arrays, *vals)
            if got is not None:  # a result returned, not written? (see check_return)
                written = prog.access(len(arrays))[0]
                check_return(prog.name, got, [arrays[i] for i in written])

    def _staged(self, end: Any) -> bool:
        return not self.host_visible and isinstance(end, cmd.HostMemoryRef)

    def _copy(self, c: Any) -> None:
        n = c.nbytes
        if not (self._staged(c.src) or self._staged(c.dest)):
            _memmove(c.dest.va_addr, c.src.va_addr, n)
            return
        src = c.src.va_addr
        self._through_staging(
            c.dest.va_addr, n, lambda chunk, offset, size: _memmove(chunk, src + offset, size)
        )

    def _copies_on_compute(self) -> bool:
        return self.host_visible  # the staging ring has the copy engine as its one user

    def _copy_plain(self, c: Any) -> None:
        """A copy on the compute queue: never through the staging ring."""
        if self._staged(c.src) or self._staged(c.dest):
            raise InvalidCommand(
                f"{self.name}: a copy through the staging ring must run on the copy queue "
                "(got one on the compute queue)"
            )
        _memmove(c.dest.va_addr, c.src.va_addr, c.nbytes)

    def _through_staging(
        self, dest: int, nbytes: int, fill: Callable[[int, int, int], object]
    ) -> None:
        """Move ``nbytes`` to address ``dest`` through the staging ring, a chunk at a time:
        ``fill(chunk_address, offset, size)`` writes the chunk, then it is copied out.
        Copy engine only: the ring is plain bookkeeping, with that thread its one user."""
        self._drain.copy(self.staging, dest, nbytes, fill, self._timeline.reserved)

    def _load_file(self, c: Any) -> None:
        dest: Buffer = c.dest
        fd = os.open(c.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if self.host_visible:
                _read_exactly(fd, _bytes_at(dest.va_addr, c.nbytes), c.offset, c.path)
                return
            self._through_staging(
                dest.va_addr,
                c.nbytes,
                lambda chunk, offset, size: _read_exactly(
                    fd, _bytes_at(chunk, size), c.offset + offset, c.path
                ),
            )
        finally:
            os.close(fd)

    def _release(self) -> None:
        super()._release()
        if not self._hung:
            self._drain.close()
            self.staging.close()


def _read_exactly(fd: int, into: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise EOFError(f"{path!r} ended after {offset + done} bytes")
        done += got


def _encode_exec(c: Any) -> tuple[bytes, None, bytes] | None:
    """A C kernel's call with concrete arguments as a lane record: the kernel's trampoline
    over a table of its arguments (cached per argument tuple on the program, so a repeat
    call costs a dict lookup; the command keeps its table alive)."""
    args = c.args
    prog = c.program
    if args is None or prog.kernel is None:
        return None
    known = prog.native_calls.get(args)
    if known is None:
        if not prog.trampoline:
            prog.trampoline = trampoline(prog.kernel)
        table = struct.pack(f"<{max(1, len(args))}q", *(wrap64(a) for a in args or (0,)))
        address = ctypes.cast(ctypes.c_char_p(table), ctypes.c_void_p).value
        record = REC.pack(OP_CALL, prog.trampoline, prog.kernel.address, address, 0)
        if len(prog.native_calls) >= 64:
            prog.native_calls.clear()  # queued commands keep their own tables
        known = prog.native_calls[args] = (record, table)
    return known[0], None, known[1]


def _encode_run(c: RunC) -> tuple[bytes, None, None]:
    """A fused run of C kernels (``crunner``): one call of its entry over its tables (the
    RunC, which the queued command list holds, keeps them)."""
    entry = ctypes.cast(c.entry, ctypes.c_void_p).value
    table = array_address(c.table)
    return REC.pack(OP_CALL, entry, ctypes.addressof(c.fns), table, 0), None, None
