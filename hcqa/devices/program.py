"""Programs: kernels bound to a device, called like functions.

Theory of operation
-------------------
``device.program(name, src)`` makes a :class:`Program`. ``src`` is either a
Python callable, which the engine thread calls with numpy views of the buffers
followed by the int vals, or C source, compiled once (cached on disk by source
hash) and called through ctypes with the buffers' addresses followed by the int
vals -- ctypes releases the GIL for the call.

Calling a program validates everything *on the caller's task* -- buffer types
and devices, argument counts, value ranges, sizes -- and raises
:class:`~hcqa.errors.InvalidCommand` before anything is queued. Then it
enqueues one ``Exec`` on the device's compute queue and returns the
:class:`~hcqa.signals.Fence` the timeline will reach when it is done.

Launch geometry reaches the kernel, resolved to 3-tuples of ints, or is refused:

* a Python kernel that declares keyword-only ``global_size`` and/or ``local_size``
  parameters gets them as keywords (``def k(out, a, *, global_size, local_size)``);
* a C kernel made with ``device.program(..., geometry=True)`` takes six more ``int``
  parameters after its vals -- ``gx, gy, gz, lx, ly, lz`` -- filled in by hcqa;
* any other kernel runs with ``(1, 1, 1)`` only: a different size (given as an int, or
  resolved from a Variable at submit or replay) is :class:`InvalidCommand`, never
  silently dropped.

By default a program writes its first buffer and reads the others; declare
``writes=`` / ``reads=`` (buffer positions) otherwise. The device uses this to
order the program against copies and transfers on other queues; the graph
executor uses it to find dependencies.
"""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from hcqa import commands as cmd
from hcqa.devices.buffer import Buffer, DeviceRef
from hcqa.devices.capture import current_capture
from hcqa.devices.launch import _Launch
from hcqa.errors import InvalidCommand
from hcqa.signals import Fence, Signal
from hcqa.variables import Expr, IntLike, Variable

if TYPE_CHECKING:
    from hcqa._native.compiler import CKernel

__all__ = ["Program", "check_flags", "check_return"]


def _int_range(ctype: type) -> tuple[int, int]:
    bits = ctypes.sizeof(ctype) * 8
    signed = ctype(-1).value == -1
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


def _positional_count(fn: Callable[..., Any]) -> int | None:
    """How many positional arguments ``fn`` takes, or None if it takes any number."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    n = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n


_ONE = (1, 1, 1)
GEOMETRY = ("global_size", "local_size")


def _keyword_only(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Which of ``global_size`` / ``local_size`` ``fn`` declares keyword-only."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(
        n for n in GEOMETRY if n in params and params[n].kind is inspect.Parameter.KEYWORD_ONLY
    )


def _check_plain_function(name: str, fn: Callable[..., Any]) -> None:
    """Refuse kernels whose call would do nothing: an ``async def`` or generator function
    only builds a coroutine or generator object, which the engine would drop unrun."""
    call = getattr(fn, "__call__", None)  # noqa: B004  (a callable object's method)
    for f in (fn, call):
        if f is None:
            continue
        for test, what in (
            (inspect.iscoroutinefunction, "an async def function"),
            (inspect.isasyncgenfunction, "an async generator function"),
            (inspect.isgeneratorfunction, "a generator function"),
        ):
            if test(f):
                raise InvalidCommand(
                    f"program {name!r} must be a plain function that does the work when "
                    f"called (got {what}: calling it would only build an object, run nothing)"
                )


def check_return(name: str, got: object, written: Sequence[Any]) -> None:
    """Refuse a Python kernel's result that it *returned* instead of writing.

    hcqa drops a kernel's return value, so ``return a * 2`` would leave ``out`` as it
    was, silently. An array or a number returned is refused, unless it is (a view of) a
    buffer the kernel writes: ``np.add(a, 1, out=out)`` returns ``out`` itself. Anything
    else a kernel returns (``None``, ``Event.wait``'s bool, ``os.write``'s int) passes."""
    if got is None:
        return
    if isinstance(got, np.ndarray):
        if any(np.may_share_memory(got, w) for w in written):
            return
        what = f"an array ({got.dtype} {tuple(got.shape)})"
    elif isinstance(got, (np.generic, float, complex)):
        what = f"a number ({got!r})"
    else:
        return
    raise InvalidCommand(
        f"kernel {name!r} must write its result into its output buffer (got {what} "
        "returned, which hcqa drops): write `out[...] = result`, or pass `out=out` to the "
        "numpy call"
    )


def check_flags(flags: object) -> tuple[str, ...]:
    """``program(..., flags=)`` checked: a tuple or list of str without NUL."""
    if not isinstance(flags, (tuple, list)):
        raise InvalidCommand(
            f"'flags' must be a tuple of str compiler flags (got {type(flags).__name__})"
        )
    for f in flags:
        if not isinstance(f, str):
            raise InvalidCommand(f"'flags' must hold str (got {type(f).__name__}: {f!r})")
        if not f or "\0" in f:
            raise InvalidCommand(f"'flags' must hold non-empty str without NUL (got {f!r})")
    return tuple(flags)


def _size3(name: str, value: object) -> tuple[IntLike, IntLike, IntLike]:
    if isinstance(value, (int, Variable, Expr)) and not isinstance(value, bool):
        value = (value, 1, 1)
    if not isinstance(value, (tuple, list)) or not 1 <= len(value) <= 3:
        raise InvalidCommand(f"{name!r} must be a tuple of 1 to 3 ints (got {value!r})")
    out: list[IntLike] = []
    for d in value:
        if isinstance(d, (Variable, Expr)) or (
            isinstance(d, int) and not isinstance(d, bool) and d > 0
        ):
            out.append(d)
        else:
            raise InvalidCommand(f"{name!r} must hold positive ints (got {value!r})")
    while len(out) < 3:
        out.append(1)
    return out[0], out[1], out[2]


class Program:
    """A kernel on one device; ``prog(*bufs, vals=())`` enqueues it and returns a Fence."""

    def __init__(
        self,
        device: DeviceRef,
        name: str,
        *,
        fn: Callable[..., Any] | None = None,
        kernel: CKernel | None = None,
        writes: Sequence[int] | None = None,
        reads: Sequence[int] | None = None,
        geometry: bool = False,
    ) -> None:
        self.device = device
        self.name = name
        self.fn = fn
        self.kernel = kernel
        self.kind = "c" if kernel is not None else "python"
        if not isinstance(geometry, bool):
            raise InvalidCommand(f"'geometry' must be a bool (got {type(geometry).__name__})")
        # the launch-geometry arguments this kernel receives (see the module doc)
        self.geometry: tuple[str, ...] = ()
        if kernel is not None:
            self.n_buffers: int | None = kernel.n_buffers
            self.n_vals: int | None = kernel.n_vals
            # (name, lo, hi) of each val parameter, in order
            ranges = tuple((p.name, *_int_range(p.ctype)) for p in kernel.params if not p.pointer)
            if geometry:
                if kernel.n_vals < 6:
                    raise InvalidCommand(
                        f"{name!r} with geometry=True must end with 6 int parameters "
                        f"(gx, gy, gz, lx, ly, lz) (got {kernel.n_vals} int parameters)"
                    )
                self.n_vals = kernel.n_vals - 6
                self.geometry = GEOMETRY
                self._geometry_ranges = ranges[-6:]
                ranges = ranges[:-6]
            self.val_ranges: tuple[tuple[str, int, int], ...] | None = ranges
        else:
            assert fn is not None
            if geometry:
                raise InvalidCommand(
                    "'geometry' is for C kernels (got a Python callable: declare keyword-only "
                    "'global_size' / 'local_size' parameters instead)"
                )
            _check_plain_function(name, fn)
            self.n_buffers = None
            self.n_vals = None
            self.val_ranges = None
            self._n_args = _positional_count(fn)
            self.geometry = _keyword_only(fn)
        self.writes = None if writes is None else self._positions("writes", writes)
        self.reads = None if reads is None else self._positions("reads", reads)
        self._access: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._launch: _Launch | None = None  # the last eager call, checked (see _Launch)
        # A native lane's records of this C kernel's calls, by argument tuple (record,
        # argument table), and the trampoline it calls the kernel through (see crunner).
        self.native_calls: dict[tuple[int, ...], tuple[bytes, bytes]] = {}
        self.trampoline = 0

    def _positions(self, what: str, positions: Sequence[int]) -> tuple[int, ...]:
        if isinstance(positions, int):
            positions = (positions,)
        if not isinstance(positions, (tuple, list, range)):
            raise InvalidCommand(
                f"{what!r} must be a tuple of buffer positions (got {type(positions).__name__})"
            )
        out = tuple(positions)
        for p in out:
            if not isinstance(p, int) or isinstance(p, bool) or p < 0:
                raise InvalidCommand(f"{what!r} must hold buffer positions >= 0 (got {p!r})")
            if self.n_buffers is not None and p >= self.n_buffers:
                raise InvalidCommand(
                    f"{what!r} must hold positions < {self.n_buffers} for {self.name!r} (got {p})"
                )
        return out

    def access(self, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(written, read) buffer positions for a call with ``n`` buffers (worked out once
        per ``n``: every eager call asks)."""
        known = self._access.get(n)
        if known is None:
            known = self._access[n] = self._work_out_access(n)
        return known

    def _work_out_access(self, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        writes = self.writes if self.writes is not None else ((0,) if n else ())
        if self.reads is not None:
            reads = self.reads
        else:
            reads = tuple(i for i in range(n) if i not in writes)
        for p in (*writes, *reads):
            if p >= n:
                raise InvalidCommand(
                    f"{self.name!r} declares buffer position {p} but was called with {n} buffers"
                )
        return writes, reads

    # -- validation ----------------------------------------------------------------------

    def validate(
        self,
        bufs: Sequence[object],
        vals: Sequence[object],
        global_size: object,
        local_size: object,
    ) -> cmd.Exec:
        """Check a call's arguments; the Exec command it makes (vals may be symbolic)."""
        for i, b in enumerate(bufs):
            if not isinstance(b, Buffer):
                raise InvalidCommand(
                    f"{self.name!r} buffer {i} must be a hcqa.Buffer (got {type(b).__name__})"
                )
            if b.device is not self.device:
                raise InvalidCommand(
                    f"{self.name!r} buffer {i} must be on {self.device.name} "
                    f"(got a buffer on {b.device.name})"
                )
            b._check()
        if not isinstance(vals, (tuple, list)):
            raise InvalidCommand(f"'vals' must be a tuple of ints (got {type(vals).__name__})")
        if any(isinstance(v, np.integer) for v in vals):
            vals = [int(v) if isinstance(v, np.integer) else v for v in vals]
        for i, v in enumerate(vals):
            if not isinstance(v, (int, Variable, Expr)) or isinstance(v, bool):
                raise InvalidCommand(
                    f"{self.name!r} val {i} must be an int (got {type(v).__name__})"
                )
        if self.kernel is not None:
            self._check_arity(bufs, vals)
        elif self._n_args is not None and len(bufs) + len(vals) != self._n_args:
            raise InvalidCommand(
                f"{self.name!r} takes {self._n_args} arguments (buffers then vals) "
                f"(got {len(bufs)} buffers and {len(vals)} vals)"
            )
        gs, ls = _size3("global_size", global_size), _size3("local_size", local_size)
        self.check_geometry(gs, ls)
        return cmd.Exec(
            program=self,
            buffers=tuple(bufs),  # type: ignore[arg-type, unused-ignore]
            vals=tuple(vals),  # type: ignore[arg-type, unused-ignore]
            global_size=gs,
            local_size=ls,
            args=self.c_args(bufs, vals, gs, ls),  # type: ignore[arg-type]
        )

    def check_geometry(self, global_size: Sequence[IntLike], local_size: Sequence[IntLike]) -> None:
        """Refuse a concrete geometry other than (1, 1, 1) that the kernel can't receive
        (symbolic sizes are checked once resolved)."""
        for name, dims in zip(GEOMETRY, (global_size, local_size), strict=True):
            if name in self.geometry or all(type(d) is not int or d == 1 for d in dims):
                continue
            how = (
                "make it with program(..., geometry=True)"
                if self.kernel is not None
                else f"declare a keyword-only {name!r} parameter"
            )
            raise InvalidCommand(
                f"{self.name!r} can't receive {name!r}: it must be (1, 1, 1) (got "
                f"{tuple(dims)}); to pass it, {how}"
            )
        if self.kernel is not None and self.geometry:
            for v, (pname, lo, hi) in zip(
                (*global_size, *local_size), self._geometry_ranges, strict=True
            ):
                if type(v) is int and not lo <= v <= hi:
                    raise InvalidCommand(
                        f"{self.name!r} geometry parameter {pname!r} must be in [{lo}, {hi}] "
                        f"(got {v})"
                    )

    def _check_arity(self, bufs: Sequence[object], vals: Sequence[object]) -> None:
        """Refuse a call whose buffer or val count is not the kernel's (``n_buffers``,
        ``n_vals``), then concrete vals out of their C types' range (``check_vals``): the
        C kernel's check here, and each driver backend's after the core ``validate``."""
        if len(bufs) != self.n_buffers or len(vals) != self.n_vals:
            raise InvalidCommand(
                f"{self.name!r} takes {self.n_buffers} buffers and "
                f"{self.n_vals} vals (got {len(bufs)} buffers and {len(vals)} vals)"
            )
        self.check_vals(vals)

    def check_buffers(self, bufs: Sequence[Buffer]) -> None:
        """Refuse buffers this kernel can't take as arguments (a backend's rule: an OpenCL
        view's alignment); checked at each call and for each buffer a replay rebinds."""

    def c_args(
        self,
        bufs: Sequence[Buffer],
        vals: Sequence[IntLike],
        global_size: Sequence[IntLike] = _ONE,
        local_size: Sequence[IntLike] = _ONE,
    ) -> tuple[int, ...] | None:
        """A C kernel's call arguments (buffer addresses, vals, then the geometry if it
        takes it), when every one is concrete (else None). A symbolic launch size makes
        them None even for a kernel that does not receive it: it must still be resolved
        and checked (``check_geometry``) before each run, never dropped."""
        if self.kernel is None or not all(type(v) is int for v in vals):
            return None
        geometry = (*global_size, *local_size)
        if not all(type(v) is int for v in geometry):
            return None
        if self.geometry:
            return (*(b.va_addr for b in bufs), *vals, *geometry)  # type: ignore[arg-type]
        return (*(b.va_addr for b in bufs), *vals)  # type: ignore[arg-type]

    def check_vals(self, vals: Sequence[object]) -> None:
        """Range-check concrete vals against the C parameter types."""
        if self.val_ranges is None:
            return
        for v, (name, lo, hi) in zip(vals, self.val_ranges, strict=True):
            if isinstance(v, int) and not lo <= v <= hi:
                raise InvalidCommand(
                    f"{self.name!r} val {name!r} must be in [{lo}, {hi}] (got {v})"
                )

    # -- calling -------------------------------------------------------------------------

    def __call__(
        self,
        *bufs: Buffer,
        vals: Sequence[IntLike] = (),
        global_size: Sequence[IntLike] | int = _ONE,
        local_size: Sequence[IntLike] | int = _ONE,
    ) -> Fence:
        """Enqueue one run of the program; the Fence is reached when it is done."""
        launch = self._launch
        if launch is not None and launch.matches(bufs, vals, global_size, local_size):
            for b in bufs:  # the one check that can change between calls: freed, closed
                b._check()
            exec_ = launch.exec_for(self, bufs)
            fence = self._enqueue(exec_, concrete=True, access=launch.access)
            if launch.native is None and self.device.shares_native:  # the executor's cache
                launch.native = exec_.native
            return fence
        exec_ = self.validate(bufs, vals, global_size, local_size)
        self._launch = _Launch.of(exec_, vals, global_size, local_size)
        return self._enqueue(exec_)

    def _enqueue(
        self,
        exec_: cmd.Exec,
        *,
        timed: tuple[Signal, Signal] | None = None,
        concrete: bool = False,
        access: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    ) -> Fence:
        """Submit one checked Exec of this program to the device's compute queue (the rest
        of the path: ``Device._submit``). ``concrete``: every val and size is known to be
        an int (the launch record's); ``timed``: signals stamped just before and after;
        ``access``: ``self.access(len(exec_.buffers))`` when the caller has it."""
        if not concrete and current_capture() is None:
            for v in (*exec_.vals, *exec_.global_size, *exec_.local_size):
                if not isinstance(v, int):
                    raise InvalidCommand(
                        f"{self.name!r}: variable {v} is unbound outside a capture "
                        "(pass ints, or use a Queue with var_vals / hcqa.capture())"
                    )
        writes, reads = self.access(len(exec_.buffers)) if access is None else access
        bufs = cast("tuple[Buffer, ...]", exec_.buffers)  # checked by validate
        commands: list[Any] = [exec_]
        if timed is not None:
            commands = [cmd.Timestamp(signal=timed[0]), exec_, cmd.Timestamp(signal=timed[1])]
        device = self.device
        return device._submit(
            device.compute,
            commands,
            reads=[bufs[i] for i in reads] if reads else (),
            writes=[bufs[i] for i in writes] if writes else (),
            waits=False,
        )

    async def timed(
        self,
        *bufs: Buffer,
        vals: Sequence[IntLike] = (),
        global_size: Sequence[IntLike] | int = (1, 1, 1),
        local_size: Sequence[IntLike] | int = (1, 1, 1),
    ) -> float:
        """Run the program once and return its kernel time in seconds, from the device
        timestamps written just before and just after it."""
        if current_capture() is not None:
            raise InvalidCommand(f"{self.name!r}.timed() can't be captured: call the program")
        exec_ = self.validate(bufs, vals, global_size, local_size)
        start, end = Signal(name=f"{self.name} start"), Signal(name=f"{self.name} end")
        fence = self._enqueue(exec_, timed=(start, end))
        await fence  # if this is cancelled, the queued Timestamps keep both signals alive
        seconds = (end._stamp.value - start._stamp.value) / 1e9
        start.close()
        end.close()
        return seconds

    def __repr__(self) -> str:
        return f"<Program {self.name!r} ({self.kind}) on {self.device.name}>"
