"""OpenCL platforms and devices as hcqa numbers them, and the process settings OpenCL needs.

Theory of operation
-------------------
``opencl:N`` names the Nth device over all OpenCL platforms, in the order the ICD loader lists
the platforms and each platform lists its devices. :func:`list_devices` is that numbering
(``hcqa info`` prints it) and :func:`cl_device` resolves one number with it, so the two never
disagree.

Two process-wide settings must be right before the first OpenCL call, because PoCL (the CPU
OpenCL hcqa installs with the ``opencl`` extra) reads them once, when it starts its worker
threads at the first platform query:

* ``POCL_MAX_PTHREAD_COUNT``: PoCL starts one worker per core by default, and numpy's BLAS
  also starts one per core. The two pools then fight for the same cores (a BLAS matmul beside a
  running kernel went from 0.2 ms to several ms at p90 on two cores). :func:`apply_thread_defaults`
  gives PoCL half the usable cores (at least one) unless the user set the variable; it only
  writes ``os.environ`` and is called before every first query below.
* ``ld`` on PATH: PoCL links every kernel's work-group function with the system linker at the
  kernel's first launch and aborts the whole process (SIGABRT) when it cannot find one.
  :func:`missing_ld` says so beforehand, so hcqa can refuse instead of dying.

Nothing here imports PyOpenCL at module level: ``hcqa info`` must work (and say how to install
it) without the extra.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import attrs

from hcqa.errors import install_hint

__all__ = [
    "POCL_THREADS",
    "ClDeviceInfo",
    "OpenCLMissing",
    "apply_thread_defaults",
    "blas_threads",
    "cl_device",
    "contention",
    "default_pocl_threads",
    "list_devices",
    "missing_ld",
    "thread_settings",
]

POCL_THREADS = "POCL_MAX_PTHREAD_COUNT"
INSTALL_HINT = install_hint("opencl")
# The BLAS libraries numpy may be built on, and the variables each reads at import.
BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

_applied: str | None = None  # what apply_thread_defaults set (None: it set nothing)


class OpenCLMissing(ImportError):
    """PyOpenCL is not installed: the message says how to install it."""


@attrs.frozen(kw_only=True)
class ClDeviceInfo:
    """One OpenCL device, numbered as ``opencl:N`` numbers it."""

    index: int  # N in "opencl:N"
    platform: str  # the platform's name and version
    name: str
    vendor: str
    version: str  # the device's OpenCL version string
    compute_units: int
    global_memory: int  # bytes
    device_type: str  # "CPU", "GPU", "ACCELERATOR", ...

    @property
    def spec(self) -> str:
        return f"opencl:{self.index}"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_pocl_threads() -> int:
    """PoCL's worker count hcqa sets when the user has not: half the usable cores, at least 1."""
    return max(1, _usable_cores() // 2)


def apply_thread_defaults() -> str | None:
    """Set ``POCL_MAX_PTHREAD_COUNT`` to :func:`default_pocl_threads` unless it is already set.

    Returns the value it set, or None when the user's own setting stands. Call it before the
    first OpenCL call of the process: PoCL reads the variable once."""
    global _applied
    if os.environ.get(POCL_THREADS, "").strip():
        return None
    value = str(default_pocl_threads())
    os.environ[POCL_THREADS] = value
    _applied = value
    return value


def thread_settings() -> list[tuple[str, str]]:
    """The thread settings in force for OpenCL and BLAS: (variable, value and whose it is)."""
    rows: list[tuple[str, str]] = []
    value = os.environ.get(POCL_THREADS, "").strip()
    if not value:
        rows.append(
            (POCL_THREADS, f"unset (hcqa sets {default_pocl_threads()} at the first OpenCL call)")
        )
    elif _applied is not None and value == _applied:
        rows.append((POCL_THREADS, f"{value} (hcqa's default: half the cores)"))
    else:
        rows.append((POCL_THREADS, f"{value} (yours)"))
    for name in BLAS_VARIABLES:
        if os.environ.get(name, "").strip():
            rows.append((name, os.environ[name].strip()))
    for pool in _blas_pools() or []:
        rows.append(
            (f"BLAS ({pool.get('internal_api', '?')})", f"{pool.get('num_threads')} thread(s)")
        )
    return rows


def _blas_pools() -> list[dict[str, Any]] | None:
    """threadpoolctl's view of numpy's BLAS (None: threadpoolctl is not installed)."""
    try:
        from threadpoolctl import threadpool_info  # type: ignore[import-untyped]
    except ImportError:
        return None
    return [p for p in threadpool_info() if p.get("user_api") == "blas"]


def blas_threads() -> int | None:
    """How many threads numpy's BLAS will use (None: unknown, threadpoolctl is not installed)."""
    pools = _blas_pools()
    return max((int(p["num_threads"]) for p in pools), default=None) if pools else None


def contention() -> str | None:
    """A warning when PoCL's and BLAS's threads together outnumber the usable cores."""
    try:
        pocl = int(os.environ.get(POCL_THREADS, "") or default_pocl_threads())
    except ValueError:
        return None
    blas = blas_threads()
    cores = _usable_cores()
    if blas is None or pocl + blas <= cores:
        return None
    return (
        f"PoCL {pocl} + BLAS {blas} threads on {cores} cores compete when both compute "
        f"(limit BLAS to {max(1, cores - pocl)}: OPENBLAS_NUM_THREADS, or threadpoolctl)"
    )


def missing_ld() -> bool:
    """True when no ``ld`` is on PATH: PoCL would abort the process at a kernel's first launch."""
    return shutil.which("ld") is None


def _pyopencl() -> Any:
    try:
        import pyopencl
    except ImportError as exc:
        raise OpenCLMissing(f"PyOpenCL is not installed: {INSTALL_HINT}") from exc
    return pyopencl


def _devices() -> list[tuple[Any, Any]]:
    """(platform, device) pairs over all platforms, in ``opencl:N`` order."""
    apply_thread_defaults()
    cl = _pyopencl()
    try:
        platforms = cl.get_platforms()
    except cl.LogicError as exc:  # PLATFORM_NOT_FOUND_KHR: a loader with no driver behind it
        if "PLATFORM_NOT_FOUND" in str(exc):
            return []
        raise
    pairs: list[tuple[Any, Any]] = []
    for p in platforms:
        try:
            devices = p.get_devices()
        except cl.LogicError:  # DEVICE_NOT_FOUND: a platform with no device of any type
            continue
        pairs.extend((p, d) for d in devices)
    return pairs


def _type_name(cl: Any, device_type: int) -> str:
    names = [
        n
        for n in ("GPU", "CPU", "ACCELERATOR", "CUSTOM")
        if device_type & getattr(cl.device_type, n, 0)
    ]
    return "/".join(names) or str(device_type)


def list_devices() -> list[ClDeviceInfo]:
    """Every OpenCL device, numbered as ``opencl:N``. Raises :class:`OpenCLMissing`."""
    cl = _pyopencl()
    out = []
    for i, (p, d) in enumerate(_devices()):
        out.append(
            ClDeviceInfo(
                index=i,
                platform=f"{p.name.strip()} ({p.version.strip()})",
                name=d.name.strip(),
                vendor=d.vendor.strip(),
                version=d.version.strip(),
                compute_units=int(d.max_compute_units),
                global_memory=int(d.global_mem_size),
                device_type=_type_name(cl, int(d.type)),
            )
        )
    return out


def cl_device(index: int) -> Any:
    """The ``pyopencl.Device`` that ``opencl:index`` names. Raises :class:`OpenCLMissing`,
    or IndexError saying how many devices there are."""
    pairs = _devices()
    if not 0 <= index < len(pairs):
        raise IndexError(
            f"opencl:{index} does not exist: {len(pairs)} OpenCL device(s) here "
            f"(opencl:0 to opencl:{len(pairs) - 1}; 'hcqa info' lists them)"
            if pairs
            else f"opencl:{index} does not exist: no OpenCL device here ('hcqa info' says why)"
        )
    return pairs[index][1]
