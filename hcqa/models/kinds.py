"""Which hcqa devices a model can be lifted to, and the tinygrad device behind each kind.

Theory of operation
-------------------
A model's kernels come from the tinygrad device whose code the hcqa device runs: C for
``cpu:N`` (tinygrad's ``CPU``), OpenCL C for ``opencl:N`` (tinygrad's ``CL``). The kind is the
part of the device's name before the colon; any other kind is refused here, by name.
"""

from __future__ import annotations

from hcqa.devices import Device
from hcqa.errors import InvalidCommand

__all__ = ["TINYGRAD", "device_kind"]

TINYGRAD = {"cpu": "CPU", "opencl": "CL"}


def device_kind(dev: object) -> str:
    """``"cpu"`` or ``"opencl"``: the kind of an open hcqa device a model can be lifted to."""
    if not isinstance(dev, Device):
        raise InvalidCommand(f"'device' must be an open hcqa Device (got {type(dev).__name__})")
    kind = dev.name.split(":", 1)[0]
    if kind not in TINYGRAD:
        raise InvalidCommand(
            f"models run on {', '.join(k + ':N' for k in TINYGRAD)} devices (got {dev.name})"
        )
    return kind
