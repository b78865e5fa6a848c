"""OpenCL C programs: built at ``program()``, called like any hcqa program.

Theory of operation
-------------------
``device.program(name, CL_SOURCE, entry="saxpy")`` builds the source for the device at once
(``-cl-kernel-arg-info``, so the kernel's parameters can be read back) and takes the kernel
``entry`` (default: ``name``). A build error is :class:`~hcqa.errors.InvalidCommand` carrying
the build log; a Python callable is refused (an OpenCL device runs OpenCL C only). Builds are
cached by PoCL itself (``$POCL_CACHE_DIR``, else ``$XDG_CACHE_HOME/pocl/kcache``): a source
built before costs tens of milliseconds instead of most of a second.

Parameters: ``__global`` (or ``__constant``) pointers first -- one per buffer, in order --
then integer scalars (``char`` to ``ulong``, ``size_t``), the call's ``vals``, range-checked
against their C types before anything is queued. Other parameter kinds (floats, vectors,
``__local`` memory) are refused when the program is made.

Geometry is HCQ's: ``global_size`` counts work-groups and ``local_size`` work-items per
group; the driver gets NDRange ``global_size * local_size`` with ``local_size``, so every
group is full (``get_num_groups`` = ``global_size``).

Launch records: the first time the executor enqueues an ``Exec`` it keeps on the command
(``Exec.native``) what the driver call needs -- the kernel, the NDRange, the local size and
the kernel arguments (OpenCL memory objects, then the vals) -- so a resubmitted command costs
one driver call. Arguments are set on the kernel object only when they differ from those of
its last launch (OpenCL captures them at each enqueue): a queue of launches with the same
arguments sets them once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import numpy as np

from hcqa import commands as cmd
from hcqa.devices.opencl.runtime import cl
from hcqa.devices.program import Program
from hcqa.errors import InvalidCommand
from hcqa.variables import Expr, IntLike, Variable

if TYPE_CHECKING:
    from hcqa.devices.base import Device
    from hcqa.devices.buffer import Buffer
    from hcqa.devices.opencl.runtime import ClHost

__all__ = ["ClProgram", "Patched", "build"]

_SCALARS = {
    "char": np.int8, "uchar": np.uint8, "unsigned char": np.uint8,
    "short": np.int16, "ushort": np.uint16, "unsigned short": np.uint16,
    "int": np.int32, "uint": np.uint32, "unsigned int": np.uint32, "unsigned": np.uint32,
    "long": np.int64, "ulong": np.uint64, "unsigned long": np.uint64,
    "size_t": np.uint64, "ptrdiff_t": np.int64, "intptr_t": np.int64, "uintptr_t": np.uint64,
}  # fmt: skip
_LOG_LIMIT = 4000


def _no_host_call(*args: Any, global_size: Any = None, local_size: Any = None) -> None:
    raise InvalidCommand("an OpenCL kernel runs on its device only, never on the host")


def build(
    device: ClHost, name: str, src: Any, entry: str | None, flags: Sequence[str] = ()
) -> tuple[Any, list[Any]]:
    """Build ``src`` for the device with build options ``flags`` (after hcqa's own
    ``-cl-kernel-arg-info``); (kernel, [(param name, numpy type or None)])."""
    pyopencl = cl()
    if callable(src):
        raise InvalidCommand(
            f"program {name!r}: an OpenCL device runs OpenCL C source (a str), "
            f"not a Python callable (got {type(src).__name__})"
        )
    if not isinstance(src, str):
        raise InvalidCommand(f"program source must be an OpenCL C str (got {type(src).__name__})")
    entry = entry if entry is not None else name
    prg = pyopencl.Program(device.context, src)
    try:
        prg.build(options=["-cl-kernel-arg-info", *flags], devices=[device.cl_device])
    except pyopencl.Error as exc:
        try:
            log = prg.get_build_info(device.cl_device, pyopencl.program_build_info.LOG).strip()
        except pyopencl.Error:
            log = ""
        log = log or str(exc)
        if len(log) > _LOG_LIMIT:
            log = log[:_LOG_LIMIT] + f"\n... ({len(log) - _LOG_LIMIT} more characters)"
        raise InvalidCommand(f"OpenCL build of {name!r} failed:\n{log}") from exc
    names = prg.get_info(pyopencl.program_info.KERNEL_NAMES).split(";")
    if entry not in names:
        raise InvalidCommand(
            f"entry {entry!r} must name a __kernel of the program (got kernels: "
            f"{', '.join(n for n in names if n) or 'none'})"
        )
    kernel = pyopencl.Kernel(prg, entry)
    params: list[Any] = []
    quals = pyopencl.kernel_arg_address_qualifier
    for i in range(kernel.get_info(pyopencl.kernel_info.NUM_ARGS)):
        pname = kernel.get_arg_info(i, pyopencl.kernel_arg_info.NAME)
        qual = kernel.get_arg_info(i, pyopencl.kernel_arg_info.ADDRESS_QUALIFIER)
        tname = kernel.get_arg_info(i, pyopencl.kernel_arg_info.TYPE_NAME).strip()
        if qual in (quals.GLOBAL, quals.CONSTANT):
            if params and params[-1][1] is not None:
                raise InvalidCommand(
                    f"kernel {entry!r} takes buffer {pname!r} after integer value "
                    f"{params[-1][0]!r}: buffers must come first, then integer values"
                )
            params.append((pname, None))
            continue
        if qual == quals.LOCAL:
            raise InvalidCommand(
                f"kernel {entry!r} parameter {pname!r} is __local memory: declare it inside "
                "the kernel (a fixed-size __local array) instead"
            )
        scalar = _SCALARS.get(tname)
        if scalar is None:
            raise InvalidCommand(
                f"kernel {entry!r} parameter {pname!r} must be a __global buffer or an integer "
                f"(got {tname}); pass other values through a buffer"
            )
        params.append((pname, scalar))
    return kernel, params


class ClProgram(Program):
    """A built OpenCL kernel on one device."""

    def __init__(
        self,
        device: Device,
        name: str,
        kernel: Any,
        params: list[Any],
        *,
        writes: Sequence[int] | None,
        reads: Sequence[int] | None,
    ) -> None:
        super().__init__(device, name, fn=_no_host_call)  # takes global_size / local_size
        self.kind = "opencl"
        self.cl_kernel = kernel
        self._types = [t for _, t in params if t is not None]
        self.n_buffers = sum(t is None for _, t in params)
        self.n_vals = len(self._types)
        self.val_ranges = tuple(
            (n, int(np.iinfo(t).min), int(np.iinfo(t).max)) for n, t in params if t is not None
        )
        self._n_args = None
        self.writes = None if writes is None else self._positions("writes", writes)
        self.reads = None if reads is None else self._positions("reads", reads)
        # the arguments the kernel holds now (set by the last launch record enqueued)
        self.cl_args: tuple[Any, ...] = ()
        self._limits = _Limits.of(kernel, cast("ClHost", device).cl_device)

    def check_geometry(self, global_size: Sequence[IntLike], local_size: Sequence[IntLike]) -> None:
        """Refuse (``InvalidCommand``) a concrete geometry the device can't launch, before
        anything is queued: a driver fails it as a command (a sticky fault) or, for PoCL
        and an NDRange of 2**32 work-items or more, kills the process."""
        super().check_geometry(global_size, local_size)
        g, n = tuple(global_size), tuple(local_size)
        if all(type(v) is int for v in (*g, *n)):
            self._limits.check(self.name, cast("tuple[int, ...]", g), cast("tuple[int, ...]", n))

    def check_buffers(self, bufs: Sequence[Buffer]) -> None:
        """Refuse a view the kernel can't take: one that does not start at a multiple of
        the device's base address alignment (``CL_DEVICE_MEM_BASE_ADDR_ALIGN``)."""
        for buf in bufs:
            if buf.offset:
                buf._mem.arg(buf.offset, buf.nbytes)  # type: ignore[attr-defined]  # misaligned?

    def validate(
        self,
        bufs: Sequence[object],
        vals: Sequence[object],
        global_size: object,
        local_size: object,
    ) -> cmd.Exec:
        exec_ = super().validate(bufs, vals, global_size, local_size)
        self._check_arity(exec_.buffers, exec_.vals)
        self.check_buffers(cast("tuple[Buffer, ...]", exec_.buffers))
        return exec_

    def record(
        self, c: cmd.Exec
    ) -> tuple[Any, tuple[int, ...], tuple[int, ...], tuple[Any, ...] | Patched]:
        """The launch record of ``c`` (executor only): (kernel, NDRange, local size, args)."""
        g = cast("tuple[int, int, int]", c.global_size)  # concrete by the time it runs
        n = cast("tuple[int, int, int]", c.local_size)
        size = (g[0] * n[0], g[1] * n[1], g[2] * n[2])
        bufs = cast("tuple[Buffer, ...]", c.buffers)
        mems = tuple(b._mem.arg(b.offset, b.nbytes) for b in bufs)  # type: ignore[attr-defined]
        args = mems + cast("tuple[int, ...]", c.vals)
        if any(type(v) is not int for v in c.vals):  # patched in place: values at launch
            return (self.cl_kernel, size, n, Patched(args))
        if args == self.cl_args:  # one tuple for equal arguments: the executor checks identity
            args = self.cl_args
        return (self.cl_kernel, size, n, args)

    def set_args(self, args: tuple[Any, ...] | Patched) -> None:
        """Make ``args`` the kernel's arguments, setting those that differ (executor only);
        a :class:`Patched` record's with its variables' values now."""
        if isinstance(args, Patched):
            args = args.now()
        now, kernel = self.cl_args, self.cl_kernel
        base = len(args) - len(self._types)
        for i, a in enumerate(args):
            if i >= len(now) or (now[i] is not a and now[i] != a):
                kernel.set_arg(i, a if i < base else self._types[i - base](a))
        self.cl_args = args


class Patched:
    """The arguments of a launch record whose vals hold variables (a queue or graph
    patched in place): resolved at each launch from the values of the latest ``Bind`` its
    executor ran (``cell[0]``), so new values cost no new command or record."""

    __slots__ = ("args", "at", "cell")

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args
        self.cell: list[Any] = [{}]  # the executor's (set at its first launch)
        self.at = tuple(i for i, a in enumerate(args) if isinstance(a, (Variable, Expr)))

    def now(self) -> tuple[Any, ...]:
        values = self.cell[0]
        out = list(self.args)
        for i in self.at:
            out[i] = values[out[i]]
        return tuple(out)


@attrs.frozen
class _Limits:
    """What a device takes for one kernel's launches (read once, when it is built)."""

    group: int  # work-items per work-group: CL_KERNEL_WORK_GROUP_SIZE for this device
    items: tuple[int, ...]  # per dimension: CL_DEVICE_MAX_WORK_ITEM_SIZES
    size_max: int  # the largest size_t: an NDRange dimension, and all of it
    total: int  # the most work-items in all (PoCL: below 2**32)
    device: str

    @classmethod
    def of(cls, kernel: Any, cl_device: Any) -> _Limits:
        pyopencl = cl()
        group = int(
            kernel.get_work_group_info(pyopencl.kernel_work_group_info.WORK_GROUP_SIZE, cl_device)
        )
        size_max = 2 ** int(cl_device.address_bits) - 1
        pocl = "Portable Computing" in cl_device.platform.name
        return cls(
            group=min(group, int(cl_device.max_work_group_size)),
            items=tuple(int(i) for i in cl_device.max_work_item_sizes),
            size_max=size_max,
            total=_POCL_TOTAL if pocl else size_max,
            device=f"{cl_device.name.strip()} ({cl_device.platform.name.strip()})",
        )

    def check(self, name: str, groups: tuple[int, ...], local: tuple[int, ...]) -> None:
        for d, (n, most) in enumerate(zip(local, self.items, strict=False)):
            if n > most:
                raise InvalidCommand(
                    f"{name!r}: 'local_size' dimension {d} must be <= {most} work-items "
                    f"(CL_DEVICE_MAX_WORK_ITEM_SIZES of {self.device}) (got {local})"
                )
        per_group = math.prod(local)
        if per_group > self.group:
            raise InvalidCommand(
                f"{name!r}: 'local_size' must hold <= {self.group} work-items in all "
                f"(the work-group size this kernel takes on {self.device}) (got {local}: "
                f"{per_group})"
            )
        sizes = tuple(g * n for g, n in zip(groups, local, strict=True))
        for d, size in enumerate(sizes):
            if size > self.size_max:
                raise InvalidCommand(
                    f"{name!r}: 'global_size' * 'local_size' must be <= {self.size_max} "
                    f"work-items (size_t) in dimension {d} (got {groups} * {local})"
                )
        total = math.prod(sizes)
        if total > self.total:
            raise InvalidCommand(
                f"{name!r}: the NDRange ('global_size' * 'local_size') must hold <= "
                f"{self.total} work-items in all on {self.device} (got {groups} * {local} "
                f"= {total})"
            )


# PoCL's pthread driver kills the process (SIGILL) for an NDRange of 2**32 work-items or more.
_POCL_TOTAL = 2**32 - 1
