"""Devices: the backend-free core, and the backends beside it.

The core -- the same for every kind of device:

* ``base.py`` -- :class:`Device`: its two queues, the path of one enqueue (hazards,
  timeline steps, inline or actor), and the seam: the few methods a backend provides
  (memory, programs, executors, clocks); its mixins ``offers.py`` (the fast paths a backend
  may offer, all off by default), ``hostcopies.py`` (copy-in, copy-out, loads),
  ``lifetime.py`` (start, close, release) and ``faults.py`` (sticky faults, hang limits);
* ``buffer.py``, ``memory.py`` -- buffers and views, hazards, host memory and its
  accounting, the staging ring; ``sizes.py`` -- the checks of sizes, shapes and dtypes;
  ``hostarrays.py`` -- host arrays as the host end of a copy;
* ``program.py`` -- programs and their validation; ``launch.py`` -- the launch record that
  lets a repeat call skip the checks;
* ``fusion.py`` -- the fusion seam: runs of launches as one command, where the backend
  offers it (``_fusable``, ``_fuse``, :class:`~hcqa.devices.fusion.FusedRun`);
* ``timeline.py``, ``timing.py`` -- the device timeline, device-timed spans;
  ``capture.py`` -- which graph records in this context;
* ``builder.py`` -- the HCQ builder as the core sees it (``QueueBuilder``: ``hcqa.Queue``
  sits above the core);
* ``backends.py``, ``opening.py`` -- ``kind:N`` specs to backend classes, ``open_devices``
  and cross-device ``transfer``.

The backends, each a package the core never imports (an import-linter contract per
backend): ``cpu/`` (host memory, engine threads and native lanes, numpy and C kernels, fused
C runs), ``opencl/`` and ``cuda/``. See docs/architecture.md, "The backend seam".
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
