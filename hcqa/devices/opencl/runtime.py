"""What every OpenCL device of the process shares: contexts, the driver entry points, the
native completion callback and its slots.

Theory of operation
-------------------
**Contexts.** One ``cl.Context`` per platform, over all of its devices, made at the first
``opencl:N`` of that platform and kept for the process: every hcqa device on the platform uses
it, so buffers and events of one are valid on the others (two hcqa devices on one OpenCL
device, or on two devices of one platform, copy with ``clEnqueueCopyBuffer``).

**The callback.** Completion is reported by ``hcqa_cl_complete`` (``callback.c``, with the
shared ``hcqa/_native/signal_store.h``), compiled by hcqa's C compiler and cache and registered
with ``clSetEventCallback`` through ctypes on the very ``libOpenCL`` that PyOpenCL loaded (its
``.libs`` directory; else the system's). It runs on a driver thread with no GIL and never calls
OpenCL: it makes the stores its slot lists (each signal's eventfd written only when a waiter of
this process needs the value: ``nativestores.py``), marks the slot fired, writes the device's
eventfd (when the pump must look) and marks the slot done -- its last touch. PyOpenCL's own
``Event.set_callback`` is never used (a thread per event, and an abort at interpreter exit with
callbacks pending).

**Slots.** A slot is 20 uint64 words (layout in ``callback.c``) in a :class:`SlotTable`, pages
of 256 slots that a device never unmaps while it lives. A slot goes back to the free list only
once its ``done`` word is set; a slot whose callback may still come after the device is gone
(a command the driver failed, which PoCL 3 never completes) is *abandoned*: pointed at a
process-wide eventfd and its page kept for the life of the process.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import threading
from pathlib import Path
from typing import Any, Protocol

from hcqa._native.compiler import compile_c
from hcqa._native.lane import library
from hcqa.devices.nativestores import (  # the completion slot: re-exported
    DONE,
    FD,
    FIRED,
    HOST_NS,
    MAX_STORES,
    NSTORES,
    STATUS,
    STORES,
    TL2_ARG,
    TL2_FN,
    TL2_SEQ,
    TL_ARG,
    TL_FN,
    TL_SEQ,
    WAKE,
    WORDS,
    SlotTable,
    Words,
    keep_forever,
    watch_forks,
)
from hcqa.devices.opencl import platforms
from hcqa.errors import InvalidCommand

__all__ = [
    "DONE",
    "FD",
    "FIRED",
    "HOST_NS",
    "MAX_STORES",
    "NSTORES",
    "STATUS",
    "STORES",
    "TL2_ARG",
    "TL2_FN",
    "TL2_SEQ",
    "TL_ARG",
    "TL_FN",
    "TL_SEQ",
    "WAKE",
    "WORDS",
    "ClHost",
    "SlotTable",
    "Words",
    "cl",
    "context_for",
    "keep_forever",
    "native",
]

CL_COMPLETE = 0

_lock = threading.Lock()
_contexts: dict[int, Any] = {}
_native: _Native | None = None
# The executor producing each OpenCL queue signal, while its device is open: a Wait on one
# of these may be kept by the driver (``ClExecutor.hold``).
producers: dict[Any, Any] = {}


class ClHost(Protocol):
    """What the executor and programs use of their OpenCL device (``device.py``)."""

    name: str
    context: Any
    cl_device: Any
    _slots: SlotTable
    _queues: dict[str, Any]
    _error: BaseException | None

    def _fault(self, exc: BaseException) -> None: ...
    def _check_failed(self, executors: list[Any]) -> None: ...
    def _wake_pump(self) -> None: ...
    def _tidy(self, executor: Any) -> None: ...
    def clock_offset_ns(self) -> int: ...
    def _unsampled(self) -> bool: ...


def cl() -> Any:
    """The ``pyopencl`` module (thread defaults applied first); InvalidCommand when missing."""
    platforms.apply_thread_defaults()
    try:
        import pyopencl
    except ImportError as exc:
        raise InvalidCommand(f"PyOpenCL is not installed: {platforms.INSTALL_HINT}") from exc
    return pyopencl


def context_for(device: Any) -> Any:
    """The process's context over all devices of ``device``'s platform."""
    pyopencl = cl()
    platform = device.platform
    key = int(platform.int_ptr)
    with _lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = pyopencl.Context(devices=platform.get_devices())
        return ctx


class _Native:
    """The driver's ``clSetEventCallback`` and the compiled callback."""

    def __init__(self) -> None:
        pyopencl = cl()
        libs = Path(pyopencl.__file__).parent / ".libs"
        found = sorted(glob.glob(str(libs / "libOpenCL*.so*")))
        path = found[0] if found else "libOpenCL.so.1"
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise InvalidCommand(f"the OpenCL loader {path!r} can't be loaded: {exc}") from exc
        set_cb = lib.clSetEventCallback
        set_cb.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
        set_cb.restype = ctypes.c_int32
        self.set_callback = set_cb
        here = Path(__file__).parent
        store = (here.parent.parent / "_native" / "signal_store.h").read_text()
        source = (
            "#define _POSIX_C_SOURCE 200809L\n"
            + store
            + (here / "callback.c").read_text()
            + (here / "runs.c").read_text()
        )
        abi = compile_c(source, "hcqa_cl_abi")
        words = (ctypes.c_int64 * 1)()
        abi.fn(ctypes.addressof(words))
        if words[0] != WORDS:
            raise InvalidCommand(f"OpenCL callback slots must be {WORDS} words (got {words[0]})")
        so = ctypes.CDLL(abi.path)
        watch_forks(so)  # its stores wake only listed waiters until the process forks
        self.callback = ctypes.cast(so.hcqa_cl_complete, ctypes.c_void_p).value or 0
        # Runs of launches in one call (``runs.py``): the driver's entry points, by address.
        fns = [
            ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
            for name in (
                "clEnqueueNDRangeKernel", "clSetKernelArg", "clReleaseEvent",
                "clSetEventCallback", "clFlush", "clCreateUserEvent", "clSetUserEventStatus",
            )
        ]  # fmt: skip
        self.fns = (ctypes.c_uint64 * 8)(*fns[:5], self.callback, *fns[5:])
        u64, i64, ptr = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
        run = so.hcqa_cl_run
        run.argtypes = [ptr, u64, ptr, i64, u64, ptr, ptr, ptr, u64, u64]
        run.restype = i64
        release = so.hcqa_cl_release
        release.argtypes = [ptr, ptr, i64]
        release.restype = None
        fns_address = ctypes.addressof(self.fns)
        self.run: Any = functools.partial(run, fns_address)
        self.release: Any = functools.partial(release, fns_address)
        lane = library()  # the C timeline the callback completes steps on (None: none here)
        self.tl_complete = (
            ctypes.cast(lane.lib.hcqa_tl_complete, ctypes.c_void_p).value or 0
            if lane is not None
            else 0
        )

    def register(self, event: Any, slot: int) -> int:
        """``clSetEventCallback(event, CL_COMPLETE, hcqa_cl_complete, slot)``: the CL status."""
        result: int = self.set_callback(event.int_ptr, CL_COMPLETE, self.callback, slot)
        return result


def native() -> _Native:
    global _native
    with _lock:
        if _native is None:
            _native = _Native()
        return _native
