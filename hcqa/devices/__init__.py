"""Devices: the backend-free core, and the backends beside it.

The core -- the same for every kind of device:

* ``base.py`` -- :class:`Device`: its two queues, the path of one enqueue (hazards,
  timeline steps, inline or actor), host copies and loads, lifetime; and the seam, the
  few methods a backend provides (memory, programs, executors);
* ``buffer.py``, ``memory.py`` -- buffers and views, hazards, host memory and its
  accounting, the staging ring; ``program.py`` -- programs, validation, the launch record;
* ``timeline.py``, ``timing.py``, ``faults.py`` -- the device timeline, device-timed spans,
  sticky faults and hang limits; ``capture.py`` -- which graph records in this context;
* ``backends.py``, ``opening.py`` -- ``kind:N`` specs to backend classes, ``open_devices``
  and cross-device ``transfer``.

The backends, each a package the core never imports: ``cpu/`` (host memory, engine
threads, numpy and C kernels) and ``opencl/``. See docs/architecture.md, "The backend seam".
"""

from hcqa.devices.base import Device, DeviceStatistics
from hcqa.devices.buffer import Buffer
from hcqa.devices.opening import open_device, open_devices, transfer
from hcqa.devices.program import Program
from hcqa.devices.timing import TimedSpan

__all__ = [
    "Buffer",
    "Device",
    "DeviceStatistics",
    "Program",
    "TimedSpan",
    "open_device",
    "open_devices",
    "transfer",
]
