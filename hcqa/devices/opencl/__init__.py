"""The OpenCL backend: ``opencl:N`` devices on PyOpenCL (the ``opencl`` extra).

``platforms`` numbers the devices and holds the process settings OpenCL needs; it imports
PyOpenCL only when asked, so ``hcqa info`` works without the extra.
"""
