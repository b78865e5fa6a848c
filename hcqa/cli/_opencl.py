"""``hcqa info``'s OpenCL rows: platforms and devices as ``opencl:N`` numbers them, whether the
linker PoCL needs is there, and the thread settings in force for PoCL and BLAS."""

from __future__ import annotations

import shutil

from hcqa.cli._base import _version

__all__ = ["opencl_rows"]


def _size(nbytes: int) -> str:
    gib = nbytes / (1 << 30)
    return f"{gib:.1f} GiB" if gib >= 1 else f"{nbytes / (1 << 20):.0f} MiB"


def opencl_rows() -> list[tuple[str, str]]:
    """(name, value) rows; a device's row is named by its spec (``opencl:0``)."""
    from hcqa.devices.opencl import platforms

    rows: list[tuple[str, str]] = []
    try:
        devices = platforms.list_devices()
    except platforms.OpenCLMissing:
        rows.append(("opencl", f"PyOpenCL not installed ({platforms.INSTALL_HINT})"))
        devices = None
    except Exception as exc:
        rows.append(
            ("opencl", f"PyOpenCL {_version('pyopencl')} installed, but listing failed: {exc}")
        )
        devices = None
    if devices is not None:
        count = f"{len(devices)} device(s)" if devices else "no OpenCL device found"
        pocl = _version("pocl-binary-distribution")
        with_pocl = f", pocl-binary-distribution {pocl}" if pocl != "unknown" else ""
        rows.append(("opencl", f"PyOpenCL {_version('pyopencl')}{with_pocl}; {count}"))
        for d in devices:
            rows.append(
                (
                    d.spec,
                    f"{d.name} [{d.device_type}] by {d.vendor}; {d.version}; "
                    f"{d.compute_units} compute units, {_size(d.global_memory)}; "
                    f"platform {d.platform}",
                )
            )
    ld = shutil.which("ld")
    rows.append(
        (
            "ld",
            ld
            if ld is not None
            else "NOT FOUND on PATH: PoCL links every kernel with it and aborts the process "
            "at a kernel's first launch without it (install binutils)",
        )
    )
    rows.extend(platforms.thread_settings())
    warning = platforms.contention()
    if warning is not None:
        rows.append(("threads", warning))
    return rows
