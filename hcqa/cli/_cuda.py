"""``hcqa info``'s CUDA rows: whether NVIDIA's cuda-bindings and a driver are there, and each
GPU as ``cuda:N`` numbers it."""

from __future__ import annotations

import importlib.util

from hcqa.cli._base import _version

__all__ = ["cuda_rows"]


def cuda_rows() -> list[tuple[str, str]]:
    """(name, value) rows; a GPU's row is named by its spec (``cuda:0``)."""
    try:  # find_spec imports the parent: without any ``cuda`` package that raises
        found = importlib.util.find_spec("cuda.bindings") is not None
    except ImportError:
        found = False
    if not found:
        return [("cuda", "cuda-bindings not installed (pip install -e '.[cuda]' in the checkout)")]
    from hcqa.devices.cuda import driver
    from hcqa.errors import InvalidCommand

    bindings = f"cuda-bindings {_version('cuda-bindings')}"
    try:
        driver.init()
    except InvalidCommand as exc:
        return [("cuda", f"{bindings}; no CUDA device: {exc}")]
    devices = driver.list_devices()
    if not devices:
        return [("cuda", f"{bindings}; the driver answered, but no CUDA device found")]
    rows = [("cuda", f"{bindings}; {len(devices)} device(s)")]
    for d in devices:
        gib = d["memory"] / (1 << 30)
        rows.append(
            (f"cuda:{d['index']}", f"{d['name']}, compute capability "
             f"{d['compute_capability']}, {gib:.1f} GiB")
        )  # fmt: skip
    return rows
