"""A stand-in for the CUDA driver and NVRTC, for the ``cuda:N`` tests on a machine without a GPU.

It answers the calls the backend makes the way ``cuda-bindings`` does (a result tuple whose
first item is the CUresult) and behaves like a driver where the backend depends on it: each
stream is an in-order worker thread; copies move real bytes (device memory is host memory
here); ``cuLaunchKernel`` copies the parameters at the call and runs a Python stand-in of the
kernel named by the source (the ``KERNELS`` below); host functions are the backend's own
compiled C functions, called on the stream's thread without the GIL, and never called once a
kernel faulted (the stream then reports ``CUDA_ERROR_ILLEGAL_ADDRESS``, as a broken context
does); events take the worker's ``time.monotonic_ns``. What it can't show -- real kernels,
real timings, the driver's own threads -- the tests check on a GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NOT_READY, ILLEGAL_ADDRESS = 0, 1, 2, 600, 700
NAMES = {
    0: b"CUDA_SUCCESS", 1: b"CUDA_ERROR_INVALID_VALUE", 2: b"CUDA_ERROR_OUT_OF_MEMORY",
    600: b"CUDA_ERROR_NOT_READY", 700: b"CUDA_ERROR_ILLEGAL_ADDRESS",
}  # fmt: skip
_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _arr(address: int, ctype: Any, n: int) -> Any:
    return np.ctypeslib.as_array((ctype * n).from_address(address))


class KernelFault(Exception):
    pass


def _inc(total: int, y: int) -> None:
    _arr(y, ctypes.c_int32, total)[:] += 1


def _saxpy(total: int, y: int, x: int, n: int, a: int) -> None:
    m = min(total, n)
    _arr(y, ctypes.c_float, m)[:] += a * _arr(x, ctypes.c_float, m)


def _scale(total: int, out: int, a: int, n: int, k: int) -> None:
    m = min(total, n)
    _arr(out, ctypes.c_float, m)[:] = _arr(a, ctypes.c_float, m) * k


def _wide(total: int, y: int, v: int, u: int) -> None:
    _arr(y, ctypes.c_int64, 2)[:] = (v, u)


def _spin(total: int, x: int, n: int) -> None:
    time.sleep(n / 5e8)  # 20_000_000 iterations: 40 ms
    _arr(x, ctypes.c_float, 1)[0] = 1 + (_arr(x, ctypes.c_float, 1)[0] - 1) * 0.9999999**n


def _bad(total: int, y: int, at: int) -> None:
    raise KernelFault(f"write to {at:#x}")


# name: (parameter ctypes, the kernel's effect given the thread count and the parameters)
KERNELS: dict[str, tuple[list[Any], Callable[..., None]]] = {
    "inc": ([ctypes.c_uint64], _inc),
    "misread": ([ctypes.c_uint64, ctypes.c_int64], lambda total, y, n: None),
    "saxpy": ([ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32], _saxpy),
    "scale": ([ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32], _scale),
    "wide": ([ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint8], _wide),
    "spin": ([ctypes.c_uint64, ctypes.c_int32], _spin),
    "bad": ([ctypes.c_uint64, ctypes.c_int64], _bad),
    "geometry": ([ctypes.c_uint64], lambda total, out: None),  # set at launch (needs dims)
}


class Handle:
    _ids = itertools.count(0x1000, 0x10)

    def __init__(self) -> None:
        self.value = next(self._ids)

    def __int__(self) -> int:
        return self.value


class Event(Handle):
    def __init__(self) -> None:
        super().__init__()
        self.ns: int | None = None
        self.recorded = 0
        self.done = 0


class Stream(Handle):
    def __init__(self, driver: FakeDriver) -> None:
        super().__init__()
        self.ops: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.pending = 0
        self.broken = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._work, name="fake-cuda-stream", daemon=True)
        self.thread.start()
        driver.streams[self.value] = self

    def put(self, op: Callable[[], None], kind: str) -> None:
        with self.lock:
            self.pending += 1
        self.ops.put((op, kind))

    def _work(self) -> None:
        while True:
            item = self.ops.get()
            if item is None:
                return
            op, _kind = item
            if not self.broken:
                try:
                    op()
                except KernelFault:
                    self.broken = ILLEGAL_ADDRESS
            with self.lock:
                self.pending -= 1


class Function(Handle):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class FakeDriver:
    """The subset of ``cuda.bindings.driver`` the backend calls."""

    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76,
    )
    CUfunction_attribute = SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK=0)
    CUctx_flags = SimpleNamespace(
        CU_CTX_SCHED_SPIN=1, CU_CTX_SCHED_YIELD=2, CU_CTX_SCHED_BLOCKING_SYNC=4
    )
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUevent_flags = SimpleNamespace(CU_EVENT_DEFAULT=0)

    def __init__(self) -> None:
        self.streams: dict[int, Stream] = {}
        self.memory: dict[int, Any] = {}
        self.host: dict[int, Any] = {}
        self.ctx = Handle()
        self.launches = 0

    # -- device, context ---------------------------------------------------------------------
    def cuInit(self, flags: int) -> tuple[int]:
        return (SUCCESS,)

    def cuGetErrorName(self, code: Any) -> tuple[int, bytes]:
        return (SUCCESS, NAMES.get(int(code), b"CUDA_ERROR_UNKNOWN"))

    def cuDeviceGetCount(self) -> tuple[int, int]:
        return (SUCCESS, 1)

    def cuDeviceGet(self, i: int) -> tuple[int, int]:
        return (SUCCESS, i)

    def cuDeviceGetName(self, n: int, dev: int) -> tuple[int, bytes]:
        return (SUCCESS, b"Fake GPU".ljust(n, b"\0"))

    def cuDeviceGetAttribute(self, attr: int, dev: int) -> tuple[int, int]:
        return (SUCCESS, 9 if attr == 75 else 0)

    def cuDeviceTotalMem(self, dev: int) -> tuple[int, int]:
        return (SUCCESS, 1 << 30)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[int, Handle]:
        return (SUCCESS, self.ctx)

    def cuDevicePrimaryCtxSetFlags(self, dev: int, flags: int) -> tuple[int]:
        self.ctx_flags = flags
        return (SUCCESS,)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[int]:
        return (SUCCESS,)

    # -- memory ----------------------------------------------------------------------------
    def _alloc(self, table: dict[int, Any], n: int) -> tuple[int, int]:
        if n > (1 << 30):
            return (OUT_OF_MEMORY, 0)
        buf = (ctypes.c_char * n)()
        table[ctypes.addressof(buf)] = buf
        return (SUCCESS, ctypes.addressof(buf))

    def cuMemAlloc(self, n: int) -> tuple[int, int]:
        return self._alloc(self.memory, n)

    def cuMemFree(self, address: int) -> tuple[int]:
        return (SUCCESS,) if self.memory.pop(int(address), None) is not None else (INVALID_VALUE,)

    def cuMemHostAlloc(self, n: int, flags: int) -> tuple[int, int]:
        return self._alloc(self.host, n)

    def cuMemFreeHost(self, address: int) -> tuple[int]:
        return (SUCCESS,) if self.host.pop(int(address), None) is not None else (INVALID_VALUE,)

    def _copy(self, dest: int, src: int, n: int, stream: Stream) -> tuple[int]:
        stream.put(lambda: ctypes.memmove(int(dest), int(src), n), "copy")
        return (SUCCESS,)

    cuMemcpyHtoDAsync = cuMemcpyDtoHAsync = cuMemcpyDtoDAsync = _copy

    # -- streams, events --------------------------------------------------------------------
    def cuStreamCreate(self, flags: int) -> tuple[int, Stream]:
        return (SUCCESS, Stream(self))

    def cuStreamQuery(self, stream: Stream) -> tuple[int]:
        if stream.broken:
            return (stream.broken,)
        return (NOT_READY,) if stream.pending else (SUCCESS,)

    def cuStreamDestroy(self, stream: Stream) -> tuple[int]:
        stream.ops.put(None)
        stream.thread.join()
        self.streams.pop(stream.value, None)
        return (SUCCESS,)

    def cuEventCreate(self, flags: int) -> tuple[int, Event]:
        return (SUCCESS, Event())

    def cuEventDestroy(self, ev: Event) -> tuple[int]:
        return (SUCCESS,)

    def cuEventRecord(self, ev: Event, stream: Stream) -> tuple[int]:
        ev.recorded += 1
        mark = ev.recorded

        def record() -> None:
            ev.ns = time.monotonic_ns()
            ev.done = mark

        stream.put(record, "event")
        return (SUCCESS,)

    def cuStreamWaitEvent(self, stream: Stream, ev: Event, flags: int) -> tuple[int]:
        mark = ev.recorded  # the event's state now (later records don't change the wait)

        def wait() -> None:
            while ev.done < mark:
                time.sleep(0.00005)

        stream.put(wait, "wait")
        return (SUCCESS,)

    def cuEventQuery(self, ev: Event) -> tuple[int]:
        return (SUCCESS,) if ev.done == ev.recorded else (NOT_READY,)

    def cuEventElapsedTime(self, start: Event, end: Event) -> tuple[int, float]:
        if start.ns is None or end.ns is None or self.cuEventQuery(end)[0]:
            return (NOT_READY, 0.0)
        return (SUCCESS, float(np.float32((end.ns - start.ns) / 1e6)))

    # -- modules, launches -------------------------------------------------------------------
    def cuModuleLoadData(self, image: bytes) -> tuple[int, Any]:
        return (SUCCESS, SimpleNamespace(image=image))

    def cuFuncGetAttribute(self, attr: int, f: Function) -> tuple[int, int]:
        return (SUCCESS, 1024)

    def cuFuncGetParamInfo(self, f: Function, i: int) -> tuple[int, int, int]:
        types = KERNELS[f.name][0]
        if i >= len(types):
            return (INVALID_VALUE, 0, 0)
        return (SUCCESS, 8 * i, ctypes.sizeof(types[i]))

    def cuModuleGetFunction(self, module: Any, name: bytes) -> tuple[int, Function]:
        return (SUCCESS, Function(name.decode()))

    def cuLaunchKernel(
        self, f: Function, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
        shared: int, stream: Stream, params: int, extra: int,
    ) -> tuple[int]:  # fmt: skip
        if bx * by * bz > 1024 or min(gx, gy, gz, bx, by, bz) < 1:
            return (INVALID_VALUE,)
        types, fn = KERNELS[f.name]
        args = [
            t.from_address(ctypes.c_void_p.from_address(params + 8 * i).value or 0).value
            for i, t in enumerate(types)
        ]  # copied now, as the driver does
        total = gx * gy * gz * bx * by * bz
        self.launches += 1
        if f.name == "geometry":
            dims = (gx, gy, gz, bx, by, bz)
            stream.put(lambda: _arr(args[0], ctypes.c_int32, 6).__setitem__(slice(None), dims), "k")
        else:
            stream.put(lambda: fn(total, *args), "kernel")
        return (SUCCESS,)

    def launch_host_func(self, handle: int, fn: int, data: int) -> int:
        """libcuda's ``cuLaunchHostFunc`` as the backend calls it (by handle and address)."""
        stream = self.streams[handle]
        call = _HOSTFN(fn)
        stream.put(lambda: call(data), "host")
        return SUCCESS


class FakeNvrtc:
    """The subset of ``cuda.bindings.nvrtc`` the backend calls."""

    nvrtcResult = SimpleNamespace(NVRTC_ERROR_INVALID_OPTION=5)

    def __init__(self) -> None:
        self.programs: dict[int, str] = {}
        self._ids = itertools.count(1)

    def nvrtcCreateProgram(
        self, src: bytes, name: bytes, n: int, h: list[Any], i: list[Any]
    ) -> Any:
        prog = next(self._ids)
        self.programs[prog] = src.decode()
        return (SUCCESS, prog)

    def nvrtcAddNameExpression(self, prog: int, name: bytes) -> tuple[int]:
        return (SUCCESS,)

    def nvrtcCompileProgram(self, prog: int, n: int, opts: list[bytes]) -> tuple[int]:
        return (6,) if "undefined_name" in self.programs[prog] else (SUCCESS,)

    def _log(self, prog: int) -> bytes:
        return b'error: identifier "undefined_name" is undefined\0'

    def nvrtcGetProgramLogSize(self, prog: int) -> tuple[int, int]:
        return (SUCCESS, len(self._log(prog)))

    def nvrtcGetProgramLog(self, prog: int, buf: bytes) -> tuple[int]:
        log = self._log(prog)
        ctypes.memmove(ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0, log, len(log))
        return (SUCCESS,)

    def nvrtcGetCUBINSize(self, prog: int) -> tuple[int, int]:
        return (SUCCESS, 16)

    def nvrtcGetCUBIN(self, prog: int, buf: bytes) -> tuple[int]:
        return (SUCCESS,)

    def nvrtcGetLoweredName(self, prog: int, name: bytes) -> tuple[int, bytes]:
        return (SUCCESS, name)

    def nvrtcGetErrorString(self, err: int) -> tuple[int, bytes]:
        return (SUCCESS, f"NVRTC error {int(err)}".encode())

    def nvrtcDestroyProgram(self, prog: int) -> tuple[int]:
        self.programs.pop(prog, None)
        return (SUCCESS,)
