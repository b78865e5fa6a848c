"""CUDA C++ programs: built by NVRTC at ``program()``, called like any hcqa program.

Theory of operation
-------------------
``device.program(name, CUDA_SOURCE, entry="saxpy")`` compiles the source with NVRTC for the
device's own architecture (``--gpu-architecture=sm_XY``: machine code, which the driver loads
without a JIT; ``compute_XY`` PTX when this NVRTC doesn't know the chip), loads it with
``cuModuleLoadData`` and takes the ``__global__`` function ``entry`` (default: ``name``),
``extern "C"`` or not (NVRTC lowers the name). A build error is
:class:`~hcqa.errors.InvalidCommand` carrying NVRTC's log.

Parameters are read from the entry's declaration in the source (:func:`parse_params`):
pointers first -- one per buffer, in order -- then integer scalars (``char`` to ``long long``,
their unsigned forms, ``int8_t`` .. ``uint64_t``, ``size_t``), the call's ``vals``,
range-checked against their C types before anything is queued. Other parameter types
(floats, structs, references) are refused when the program is made.

Geometry is HCQ's: ``global_size`` counts blocks (CUDA's grid) and ``local_size`` threads per
block, exactly ``cuLaunchKernel``'s grid and block dimensions.

Launch records: the first time the executor launches an ``Exec`` it keeps on the command
(``Exec.native``) what ``cuLaunchKernel`` needs -- the function, grid, block, and the
parameter array (one ctypes value per parameter: a buffer's device address, view offset
included, then the vals) -- so a resubmitted command is one driver call.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from hcqa import commands as cmd
from hcqa.devices.cuda import driver as drv
from hcqa.devices.program import Program
from hcqa.errors import InvalidCommand

if TYPE_CHECKING:
    from hcqa.devices.base import Device
    from hcqa.devices.buffer import Buffer

__all__ = ["CuProgram", "build", "parse_params"]

_SCALARS: dict[str, Any] = {
    "char": np.int8, "signed char": np.int8, "unsigned char": np.uint8, "int8_t": np.int8,
    "uint8_t": np.uint8, "short": np.int16, "unsigned short": np.uint16, "int16_t": np.int16,
    "uint16_t": np.uint16, "int": np.int32, "signed": np.int32, "unsigned": np.uint32,
    "unsigned int": np.uint32, "int32_t": np.int32, "uint32_t": np.uint32, "long": np.int64,
    "unsigned long": np.uint64, "long long": np.int64, "unsigned long long": np.uint64,
    "int64_t": np.int64, "uint64_t": np.uint64, "size_t": np.uint64, "ptrdiff_t": np.int64,
    "long int": np.int64, "long long int": np.int64, "unsigned long int": np.uint64,
    "unsigned long long int": np.uint64, "short int": np.int16, "unsigned short int": np.uint16,
}  # fmt: skip
_CTYPES = {
    np.int8: ctypes.c_int8, np.uint8: ctypes.c_uint8, np.int16: ctypes.c_int16,
    np.uint16: ctypes.c_uint16, np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32,
    np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64,
}  # fmt: skip
_MAX_BLOCK = (1024, 1024, 64)  # CUDA's block and grid limits (every chip since compute 3.0)
_MAX_GRID = (2**31 - 1, 65535, 65535)
_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|restrict|__restrict)\b")
_LOG_LIMIT = 4000


def _no_host_call(*args: Any, global_size: Any = None, local_size: Any = None) -> None:
    raise InvalidCommand("a CUDA kernel runs on its device only, never on the host")


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", " ", src)


def parse_params(src: str, entry: str) -> list[tuple[str, Any]]:
    """[(parameter name, numpy type, or None for a pointer)] of ``__global__`` ``entry``."""
    text = _strip_comments(src)
    pattern = (
        r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
        r"(?:__launch_bounds__\s*\([^)]*\)\s*)?" + re.escape(entry) + r"\s*\(([^)]*)\)"
    )
    found = re.findall(pattern, text)
    if not found:
        raise InvalidCommand(
            f"entry {entry!r} must name a '__global__ void {entry}(...)' function of the "
            "source (got none by that name)"
        )
    if len(found) > 1:
        raise InvalidCommand(
            f"entry {entry!r} must be declared once in the source (got {len(found)})"
        )
    params: list[tuple[str, Any]] = []
    body = " ".join(found[0].split())
    if body in ("", "void"):
        return params
    for raw in body.split(","):
        decl = _QUALIFIERS.sub(" ", raw).strip()
        m = re.fullmatch(r"(.*?)([A-Za-z_]\w*)\s*(\[\s*\])?", decl)
        if not m or (not m.group(1).strip() and not m.group(3)):
            raise InvalidCommand(f"kernel {entry!r}: parameter {raw.strip()!r} must be named")
        tname, pname = " ".join(m.group(1).replace("*", " * ").split()), m.group(2)
        if "*" in tname or m.group(3):
            if params and params[-1][1] is not None:
                raise InvalidCommand(
                    f"kernel {entry!r} takes buffer {pname!r} after integer value "
                    f"{params[-1][0]!r}: buffers must come first, then integer values"
                )
            params.append((pname, None))
            continue
        scalar = _SCALARS.get(tname)
        if scalar is None:
            raise InvalidCommand(
                f"kernel {entry!r} parameter {pname!r} must be a pointer or an integer (got "
                f"{tname!r}); pass other values through a buffer"
            )
        params.append((pname, scalar))
    return params


def _nvrtc_check(nvrtc: Any, what: str, result: Any) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise drv.CudaError(f"{what} failed: {nvrtc.nvrtcGetErrorString(err)[1]!r}", int(err))
    rest = result[1:] if isinstance(result, tuple) else ()
    return rest[0] if len(rest) == 1 else (rest or None)


def build(
    ctx: Any, arch: tuple[int, int], name: str, src: Any, entry: str | None
) -> tuple[Any, Any, list[tuple[str, Any]]]:
    """Compile and load ``src``; (module, function, params)."""
    if callable(src):
        raise InvalidCommand(
            f"program {name!r}: a CUDA device runs CUDA C++ source (a str), not a Python "
            f"callable (got {type(src).__name__})"
        )
    if not isinstance(src, str):
        raise InvalidCommand(f"program source must be a CUDA C++ str (got {type(src).__name__})")
    entry = entry if entry is not None else name
    params = parse_params(src, entry)
    driver, nvrtc = drv.bindings()
    try:
        prog = _nvrtc_check(nvrtc, "nvrtcCreateProgram", nvrtc.nvrtcCreateProgram(
            src.encode(), f"{name}.cu".encode(), 0, [], []))  # fmt: skip
    except Exception as exc:  # libnvrtc missing: the bindings' loader raises
        raise InvalidCommand(
            f"NVRTC can't be used here (the 'cuda' extra brings it): {exc}"
        ) from exc
    try:
        _nvrtc_check(nvrtc, "nvrtcAddNameExpression",
                     nvrtc.nvrtcAddNameExpression(prog, entry.encode()))  # fmt: skip
        binary, cubin = _compile(nvrtc, prog, name, arch)
        lowered = _nvrtc_check(nvrtc, "nvrtcGetLoweredName",
                               nvrtc.nvrtcGetLoweredName(prog, entry.encode()))  # fmt: skip
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    drv.current(ctx)
    try:
        module = drv.check("cuModuleLoadData", driver.cuModuleLoadData(binary))
        function = drv.check("cuModuleGetFunction", driver.cuModuleGetFunction(module, lowered))
    except drv.CudaError as exc:
        kind = "machine code" if cubin else "PTX"
        raise InvalidCommand(f"program {name!r}: the driver refused its {kind}: {exc}") from exc
    _check_layout(driver, function, entry, params)
    return module, function, params


def _check_layout(driver: Any, function: Any, entry: str, params: list[tuple[str, Any]]) -> None:
    """Refuse a kernel whose compiled parameters differ from what the source was read as
    (count or sizes: a macro, a typedef, an overload the reading got wrong), which would
    launch it with misplaced arguments. The driver says through ``cuFuncGetParamInfo``
    (CUDA 12.4+); without it the reading stands alone."""
    try:
        sizes = []
        for i in range(len(params) + 1):
            result = driver.cuFuncGetParamInfo(function, i)
            if int(result[0]) != 0:
                break
            sizes.append(int(result[2]))
    except Exception:  # an older driver or bindings: nothing to compare with
        return
    if not sizes and params:
        return  # the call is there but answers nothing: no layout to compare
    want = [8 if t is None else np.dtype(t).itemsize for _, t in params]
    if sizes != want:
        raise InvalidCommand(
            f"kernel {entry!r}: its compiled parameters must be what the source reads as "
            f"{[n for n, _ in params]} (sizes {want} bytes; got sizes {sizes})"
        )


def _compile(nvrtc: Any, prog: Any, name: str, arch: tuple[int, int]) -> tuple[bytes, bool]:
    """(image, is machine code): sm_XY machine code, else compute_XY PTX."""
    for cubin in (True, False):
        target = f"{'sm' if cubin else 'compute'}_{arch[0]}{arch[1]}"
        opts = [f"--gpu-architecture={target}".encode(), b"-default-device", b"-std=c++17"]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if int(err) == int(nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION) and cubin:
            continue  # this NVRTC doesn't know the chip: PTX for the driver to finish
        if int(err) != 0:
            size = _nvrtc_check(nvrtc, "nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * int(size)
            nvrtc.nvrtcGetProgramLog(prog, log)
            text = log.rstrip(b"\0 ").decode(errors="replace").strip()
            if len(text) > _LOG_LIMIT:
                text = text[:_LOG_LIMIT] + f"\n... ({len(text) - _LOG_LIMIT} more characters)"
            raise InvalidCommand(f"CUDA build of {name!r} failed:\n{text}")
        if cubin:
            size = _nvrtc_check(nvrtc, "nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
            image = b" " * int(size)
            _nvrtc_check(nvrtc, "nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, image))
            return image, True
        size = _nvrtc_check(nvrtc, "nvrtcGetPTXSize", nvrtc.nvrtcGetPTXSize(prog))
        image = b" " * int(size)
        _nvrtc_check(nvrtc, "nvrtcGetPTX", nvrtc.nvrtcGetPTX(prog, image))
        return image, False
    raise AssertionError("unreachable")


class CuProgram(Program):
    """A built CUDA kernel on one device."""

    def __init__(
        self,
        device: Device,
        name: str,
        module: Any,
        function: Any,
        params: list[tuple[str, Any]],
        *,
        writes: Sequence[int] | None,
        reads: Sequence[int] | None,
    ) -> None:
        super().__init__(device, name, fn=_no_host_call)  # takes global_size / local_size
        self.kind = "cuda"
        self.cu_module = module
        self.cu_function = function
        self._types = [t for _, t in params if t is not None]
        self._ctypes = [_CTYPES[t] for t in self._types]
        self.n_buffers = sum(t is None for _, t in params)
        self.n_vals = len(self._types)
        self.val_ranges = tuple(
            (n, int(np.iinfo(t).min), int(np.iinfo(t).max)) for n, t in params if t is not None
        )
        self._n_args = None
        self.writes = None if writes is None else self._positions("writes", writes)
        self.reads = None if reads is None else self._positions("reads", reads)
        driver, _ = drv.bindings()
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        self.max_threads = int(
            drv.check("cuFuncGetAttribute", driver.cuFuncGetAttribute(attr, function))
        )

    def check_geometry(self, global_size: Sequence[Any], local_size: Sequence[Any]) -> None:
        """Refuse (``InvalidCommand``) a concrete geometry CUDA can't launch, before anything
        is queued (the driver would refuse it at the launch: a sticky fault): blocks of more
        threads than this kernel takes (its registers decide), block or grid dimensions past
        CUDA's limits."""
        super().check_geometry(global_size, local_size)
        g, n = tuple(global_size), tuple(local_size)
        if not all(type(v) is int for v in (*g, *n)):
            return  # symbolic: checked once resolved
        for what, dims, limits in (("local_size", n, _MAX_BLOCK), ("global_size", g, _MAX_GRID)):
            for axis, (v, hi) in enumerate(zip(dims, limits, strict=True)):
                if v > hi:
                    raise InvalidCommand(
                        f"{self.name!r} {what}[{axis}] must be <= {hi} on CUDA (got {v})"
                    )
        threads = n[0] * n[1] * n[2]
        if threads > self.max_threads:
            raise InvalidCommand(
                f"{self.name!r} local_size must hold <= {self.max_threads} threads per block "
                f"for this kernel on {self.device.name} (got {n}: {threads})"
            )

    def validate(
        self,
        bufs: Sequence[object],
        vals: Sequence[object],
        global_size: object,
        local_size: object,
    ) -> cmd.Exec:
        exec_ = super().validate(bufs, vals, global_size, local_size)
        self._check_arity(exec_.buffers, exec_.vals)
        return exec_

    def record(self, c: cmd.Exec) -> tuple[Any, ...]:
        """The launch record of ``c`` (executor only): (function, grid, block, parameter
        array address, the ctypes objects behind it)."""
        g = cast("tuple[int, int, int]", c.global_size)  # concrete by the time it runs
        n = cast("tuple[int, int, int]", c.local_size)
        bufs = cast("tuple[Buffer, ...]", c.buffers)
        values: list[Any] = [ctypes.c_uint64(b.va_addr) for b in bufs]
        values += [t(v) for t, v in zip(self._ctypes, cast("tuple[int, ...]", c.vals), strict=True)]
        array = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        return (self.cu_function, g, n, ctypes.addressof(array), (values, array))
