"""The ``cuda:N`` backend: NVIDIA GPUs through the CUDA driver API (``cuda-bindings``).

``driver.py`` loads the bindings and the driver (only when a ``cuda:N`` spec is opened or
``hcqa info`` asks), keeps each GPU's primary context and the host functions that report
completion; ``memory.py`` serves ``cuMemAlloc`` blocks; ``program.py`` builds CUDA C++ with
NVRTC; ``executor.py`` turns a queue's runs into work on its stream; ``device.py`` is the
:class:`~hcqa.devices.cuda.device.CudaDevice` and its pump. See docs/cuda.md.

Nothing here is imported by ``import hcqa``: ``hcqa.devices.backends`` names the class by
its dotted path, so a machine without CUDA never loads the bindings.
"""
