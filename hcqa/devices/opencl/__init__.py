"""The OpenCL backend: ``opencl:N`` devices on PyOpenCL (the ``opencl`` extra).

* ``platforms.py`` -- numbers the devices and holds the process settings OpenCL needs; it
  imports PyOpenCL only when asked, so ``hcqa info`` works without the extra;
* ``runtime.py`` -- the process's OpenCL host: contexts, the native event callback and its
  completion slots;
* ``device.py`` -- :class:`~hcqa.devices.opencl.device.OpenCLDevice`: its two queues, its
  memory, its clock, and the pump (a trio task) that finishes completed segments;
* ``memory.py`` -- device memory as ``cl.Buffer`` s, cached by size class;
* ``program.py`` -- OpenCL C programs and their launch records;
* ``executor.py`` -- :class:`~hcqa.devices.opencl.executor.ClExecutor`: a run of commands
  enqueued as driver commands, no thread of its own; ``copies.py`` -- copies and loads as
  driver commands; ``completion.py`` -- segments, completed by the driver's callback or the
  pump; ``waits.py`` -- Waits the driver keeps (a cross-queue wait as an event wait list,
  the backend's ``_driver_wait`` fast path).

Everything else -- queues, timeline, hazards, faults, hang limits, capture -- is the
backend-free core in :mod:`hcqa.devices`; see docs/architecture.md, "The backend seam".
"""
