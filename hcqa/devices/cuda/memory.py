"""Device memory of a CUDA device: ``cuMemAlloc`` blocks behind hcqa Buffers.

Theory of operation
-------------------
:class:`CuAllocator`, a :class:`~hcqa.devices.driverpool.DriverPool` (the caching allocator
every driver backend shares), serves :class:`CuMemory` blocks: one ``cuMemAlloc`` each (plain
device memory, never managed memory), in the size classes of host memory, freed blocks cached
for reuse (LRU, evicted when a new block would pass the capacity, or when the driver says it
is out of memory).

A block's ``address`` is its real device pointer: a Buffer's ``va_addr`` (address + view
offset) is what a kernel argument or a copy takes. The host never dereferences it (the
device is not host-visible). A block freed while commands that use it are queued stays
valid: those commands hold the hcqa Buffer until their completion is processed.
"""

from __future__ import annotations

from typing import Any

from hcqa.devices.cuda import driver as drv
from hcqa.devices.driverpool import DriverPool
from hcqa.errors import OutOfMemory

__all__ = ["CuAllocator", "CuMemory"]

_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class CuMemory:
    """One ``cuMemAlloc`` block of ``capacity`` bytes at ``address``, serving ``nbytes``."""

    fd = None  # never shared with other processes
    charged = 0

    def __init__(self, address: int, capacity: int, ctx: Any) -> None:
        self.address = address
        self.capacity = capacity
        self._nbytes = capacity
        self._ctx = ctx
        self._closed = False

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    def _resize(self, nbytes: int) -> None:
        self._nbytes = nbytes

    def close(self) -> None:
        """``cuMemFree`` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        driver, _ = drv.bindings()
        try:
            drv.current(self._ctx)
        except drv.CudaError:
            return  # a broken context (a GPU fault): nothing to free it with
        driver.cuMemFree(self.address)  # (an error here is a broken context's: ignored)

    def __repr__(self) -> str:
        return f"<CuMemory {self._nbytes} bytes at {self.address:#x}>"


class CuAllocator(DriverPool[CuMemory]):
    """Size-classed ``cuMemAlloc`` blocks with an LRU cache of freed ones (``DriverPool``)."""

    driver = "CUDA"

    def __init__(self, *, capacity: int, name: str, ctx: Any) -> None:
        super().__init__(capacity=capacity, name=name)
        self._ctx = ctx

    def _new_block(self, size: int, nbytes: int) -> CuMemory:
        driver, _ = drv.bindings()
        drv.current(self._ctx)
        while True:
            try:
                address = int(drv.check("cuMemAlloc", driver.cuMemAlloc(size)))
                return CuMemory(address, size, self._ctx)
            except drv.CudaError as exc:
                if exc.code == _OUT_OF_MEMORY and self._lru:
                    self._evict_oldest()  # cached blocks first, then try again
                    continue
                raise OutOfMemory(
                    f"{self.name}: CUDA could not allocate {size} bytes for 'nbytes' "
                    f"{nbytes}: {exc}"
                ) from exc
