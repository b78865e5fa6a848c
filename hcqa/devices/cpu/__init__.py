"""The ``cpu:N`` backend: host memory, engine threads, numpy and C kernels.

* ``device.py`` -- :class:`CpuDevice`: the handlers its engine threads run (a kernel is a
  Python callable on numpy views or a C function through ctypes; copies are ``memmove``;
  loads are ``preadv``), the staging ring for ``host_visible=False``, and which short
  commands may run inline on the caller's thread;
* ``crunner.py`` -- the native runner: a run of C kernels fused into one native call over
  an argument table, ``RunC``, the cpu backend's offer at the fusion seam
  (``CpuDevice._fusable`` / ``_fuse``; graphs and resubmitted queues reach it only through
  ``hcqa/devices/fusion.py``).

Everything else -- queues, timeline, hazards, faults, hang limits, capture -- is the
backend-free core in :mod:`hcqa.devices`; see docs/architecture.md, "The backend seam".
"""

from hcqa.devices.cpu.device import INLINE_COPY_MAX, CpuDevice

__all__ = ["INLINE_COPY_MAX", "CpuDevice"]
