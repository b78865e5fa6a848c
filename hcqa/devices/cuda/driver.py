"""What every CUDA device of the process shares: the driver, primary contexts, the host
functions and their slots.

Theory of operation
-------------------
**The driver.** NVIDIA's ``cuda-bindings`` (``cuda.bindings.driver``, ``.nvrtc``) is imported
only here and only when a ``cuda:N`` spec is opened or ``hcqa info`` asks: :func:`bindings`
refuses with :class:`~hcqa.errors.InvalidCommand` when the package is missing, and
:func:`init` when ``cuInit`` fails (no driver, no GPU). :func:`list_devices` never raises:
it is empty then. Every driver call's result goes through :func:`check`, which turns a
``CUresult`` other than success into :class:`CudaError` (its name and the call).

**Contexts.** Each GPU's *primary* context (``cuDevicePrimaryCtxRetain``), retained once
and kept for the process, so every hcqa device on one GPU shares memory and events. A CUDA
context is current per thread: :func:`current` makes it so on the calling thread, once per
(thread, context).

**Host functions.** Completion is ``hcqa_cu_complete`` (``hostfn.c`` with the shared
``hcqa/_native/signal_store.h``), compiled by hcqa's C compiler and enqueued with
``cuLaunchHostFunc`` called through ctypes on ``libcuda`` itself, so the driver thread calls
the C function directly: no GIL, no Python (the bindings' own ``cuLaunchHostFunc`` wraps the
function in one that takes the GIL). Without a C compiler a ctypes callback stands in: it
takes the GIL on the driver thread, marks the slot and always wakes the pump (slower;
``native().c_host_functions`` says which is in use).

**Slots** are the OpenCL callback's layout (see ``hostfn.c``): 20 uint64 words in pages a
device never unmaps while it lives; a slot goes back to the free list once its ``done`` word
is set, and one whose host function may still run after its device is gone is *abandoned*
(pointed at a process-wide eventfd, its page kept for the life of the process).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

from hcqa._native.compiler import compile_c
from hcqa._native.lane import library
from hcqa.devices.nativestores import (  # the completion slot: re-exported
    DONE,
    FD,
    FIRED,
    HOST_NS,
    MAX_STORES,
    NSTORES,
    PRE,
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
from hcqa.errors import HcqaError, InvalidCommand, install_hint

__all__ = [
    "DONE",
    "FD",
    "FIRED",
    "HOST_NS",
    "MAX_STORES",
    "NSTORES",
    "PRE",
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
    "CudaError",
    "SlotTable",
    "Words",
    "bindings",
    "check",
    "context",
    "current",
    "keep_forever",
    "list_devices",
    "native",
]


_lock = threading.Lock()
_contexts: dict[int, Any] = {}
_native: _Native | None = None
_local = threading.local()
_init_error: str | None = None
_initialised = False


class CudaError(HcqaError):
    """A CUDA driver or NVRTC call that did not succeed (``code``: its CUresult)."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


def bindings() -> tuple[Any, Any]:
    """``(cuda.bindings.driver, cuda.bindings.nvrtc)``; InvalidCommand when missing."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as exc:
        raise InvalidCommand(
            f"the CUDA backend needs NVIDIA's cuda-bindings: {install_hint('cuda')} ({exc})"
        ) from None
    return driver, nvrtc


def error_name(code: Any) -> str:
    driver, _ = bindings()
    try:
        err, name = driver.cuGetErrorName(code)
        if int(err) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # an unknown code: the number is all there is
        pass
    return f"CUresult {int(code)}"


def check(what: str, result: Any) -> Any:
    """The value(s) of a driver call's result tuple; CudaError unless it succeeded."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    code = int(err)
    if code != 0:
        raise CudaError(f"{what} failed: {error_name(err)}", code)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def init() -> Any:
    """cuInit once; the driver module. InvalidCommand when there is no usable driver."""
    global _initialised, _init_error
    driver, _ = bindings()
    with _lock:
        if not _initialised:
            try:
                result = driver.cuInit(0)
                code = int(result[0] if isinstance(result, tuple) else result)
                _init_error = None if code == 0 else error_name(code)
            except Exception as exc:  # no libcuda at all (the bindings' loader raises)
                _init_error = f"{type(exc).__name__}: {exc}"
            _initialised = True
    if _init_error is not None:
        raise InvalidCommand(f"the CUDA driver can't be used here: cuInit: {_init_error}")
    return driver


def list_devices() -> list[dict[str, Any]]:
    """One dict per GPU (index, name, compute capability, memory); [] when none is usable."""
    try:
        driver = init()
        count = check("cuDeviceGetCount", driver.cuDeviceGetCount())
        out = []
        for i in range(int(count)):
            dev = check("cuDeviceGet", driver.cuDeviceGet(i))
            raw = check("cuDeviceGetName", driver.cuDeviceGetName(256, dev))
            name = raw.split(b"\0", 1)[0].decode() if isinstance(raw, bytes) else str(raw)
            attr = driver.CUdevice_attribute
            major = check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))  # fmt: skip
            minor = check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))  # fmt: skip
            memory = check("cuDeviceTotalMem", driver.cuDeviceTotalMem(dev))
            out.append({
                "index": i, "name": name, "compute_capability": f"{major}.{minor}",
                "memory": int(memory),
            })  # fmt: skip
        return out
    except (InvalidCommand, CudaError):
        return []


def context(index: int) -> tuple[Any, Any]:
    """(CUdevice, primary CUcontext) of GPU ``index``, retained once for the process."""
    driver = init()
    count = int(check("cuDeviceGetCount", driver.cuDeviceGetCount()))
    if not 0 <= index < count:
        raise InvalidCommand(
            f"cuda:{index} does not exist: 'index' must be < {count}, the number of CUDA "
            f"devices here (got {index})"
        )
    with _lock:
        found = _contexts.get(index)
        if found is None:
            dev = check("cuDeviceGet", driver.cuDeviceGet(index))
            _schedule(driver, dev)
            ctx = check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(dev))
            found = _contexts[index] = (dev, ctx)
    return found


_SCHED = {"spin": "CU_CTX_SCHED_SPIN", "yield": "CU_CTX_SCHED_YIELD",
          "blocking": "CU_CTX_SCHED_BLOCKING_SYNC"}  # fmt: skip


def _schedule(driver: Any, dev: Any) -> None:
    """``HCQA_CUDA_SCHED`` (spin, yield, blocking): how the driver's threads wait for the GPU
    in the primary context (``cuDevicePrimaryCtxSetFlags``; it applies only before the context
    is first made active in the process). Unset: the driver's default (auto)."""
    name = os.environ.get("HCQA_CUDA_SCHED", "")
    if not name:
        return
    if name not in _SCHED:
        raise InvalidCommand(f"HCQA_CUDA_SCHED must be one of {', '.join(_SCHED)} (got {name!r})")
    flag = int(getattr(driver.CUctx_flags, _SCHED[name]))
    check("cuDevicePrimaryCtxSetFlags", driver.cuDevicePrimaryCtxSetFlags(dev, flag))


def current(ctx: Any) -> None:
    """Make ``ctx`` current on this thread (a CUDA context is current per thread)."""
    key = int(ctx)
    if getattr(_local, "ctx", None) != key:
        driver, _ = bindings()
        check("cuCtxSetCurrent", driver.cuCtxSetCurrent(ctx))
        _local.ctx = key


_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Native:
    """libcuda's ``cuLaunchHostFunc`` and the compiled host functions (or their fallback)."""

    def __init__(self, launch: Any = None) -> None:
        """``launch``: a stand-in for libcuda's ``cuLaunchHostFunc`` (tests without a GPU)."""
        if launch is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise InvalidCommand(f"libcuda.so.1 can't be loaded: {exc}") from exc
            launch = lib.cuLaunchHostFunc
            launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            launch.restype = ctypes.c_int
        self.launch_host_func = launch
        self.c_host_functions = True
        self._keep: list[Any] = []
        try:
            here = Path(__file__).parent
            store = (here.parent.parent / "_native" / "signal_store.h").read_text()
            source = "#define _POSIX_C_SOURCE 200809L\n" + store + (here / "hostfn.c").read_text()
            abi = compile_c(source, "hcqa_cu_abi")
            words = (ctypes.c_int64 * 1)()
            abi.fn(ctypes.addressof(words))
            if words[0] != WORDS:
                raise InvalidCommand(
                    f"CUDA host-function slots must be {WORDS} words (got {words[0]})"
                )
            clib = ctypes.CDLL(abi.path)
            watch_forks(clib)  # its stores wake only listed waiters until the process forks
            self.complete = ctypes.cast(clib.hcqa_cu_complete, ctypes.c_void_p).value or 0
            self.memcpy = ctypes.cast(clib.hcqa_cu_memcpy, ctypes.c_void_p).value or 0
        except (InvalidCommand, OSError):
            # FALLBACK (no C compiler): Python callbacks on the driver thread, under the GIL.
            self.c_host_functions = False
            complete, memcpy = _HOSTFN(_py_complete), _HOSTFN(_py_memcpy)
            self._keep += [complete, memcpy]
            self.complete = ctypes.cast(complete, ctypes.c_void_p).value or 0
            self.memcpy = ctypes.cast(memcpy, ctypes.c_void_p).value or 0
        lane = library()  # the C timeline a host function completes steps on (None: none)
        self.tl_complete = (
            ctypes.cast(lane.lib.hcqa_tl_complete, ctypes.c_void_p).value or 0
            if lane is not None and self.c_host_functions
            else 0
        )

    def host_func(self, stream: int, fn: int, data: int) -> None:
        """``cuLaunchHostFunc(stream, fn, data)``; CudaError if the driver refuses."""
        code = self.launch_host_func(stream, fn, data)
        if code != 0:
            raise CudaError(f"cuLaunchHostFunc failed: {error_name(code)}", code)


def _py_complete(user: int) -> None:  # the fallback: copies, mark fired, wake the pump, done
    words = (ctypes.c_uint64 * WORDS).from_address(user)
    if words[PRE]:
        count = int(ctypes.c_uint64.from_address(int(words[PRE])).value)
        pre = (ctypes.c_uint64 * (1 + 3 * count)).from_address(int(words[PRE]))
        for i in range(count):
            ctypes.memmove(int(pre[1 + 3 * i]), int(pre[2 + 3 * i]), int(pre[3 + 3 * i]))
    words[HOST_NS] = time_ns()
    words[FIRED] = 1
    os.eventfd_write(int(words[FD]), 1)
    words[DONE] = 1


def _py_memcpy(user: int) -> None:
    w = (ctypes.c_uint64 * 3).from_address(user)
    ctypes.memmove(int(w[0]), int(w[1]), int(w[2]))


def time_ns() -> int:
    import time

    return time.monotonic_ns()


def native() -> _Native:
    global _native
    with _lock:
        if _native is None:
            _native = _Native()
        return _native
