"""The HCQ builder as the device core sees it: what ``compute_queue()`` hands back.

Theory of operation
-------------------
``dev.compute_queue()`` and ``dev.copy_queue()`` return a :class:`hcqa.Queue` -- the builder
of ``hcqa/queue.py``, which sits above the device core and imports it, never the other way
round. The core names the builder through :class:`QueueBuilder`, the protocol of its public
verbs (``hcqa.Queue`` is checked against it where it registers itself as the class devices
build: ``Device._queue_class``), so typed code that chains verbs on a device's queue is
checked as if it held the ``Queue`` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from hcqa.variables import IntLike, Variable, VarVals

if TYPE_CHECKING:
    from typing import Self

    from hcqa.devices.buffer import Buffer
    from hcqa.devices.program import Program
    from hcqa.signals import Fence, Signal

__all__ = ["QueueBuilder"]


class QueueBuilder(Protocol):
    """The public verbs of a :class:`hcqa.Queue` (see ``hcqa/queue.py`` for each)."""

    kind: str

    def wait(self, signal: Signal, value: IntLike) -> Self: ...

    def signal(self, signal: Signal, value: IntLike) -> Self: ...

    def timestamp(self, signal: Signal) -> Self: ...

    def memory_barrier(self) -> Self: ...

    def exec(
        self,
        prog: Program,
        bufs: tuple[Buffer, ...] | list[Buffer],
        global_size: Any = (1, 1, 1),
        local_size: Any = (1, 1, 1),
        vals: tuple[IntLike, ...] | list[IntLike] = (),
    ) -> Self: ...

    def copy(self, dest: Buffer, src: Buffer, nbytes: IntLike) -> Self: ...

    @property
    def variables(self) -> set[Variable]: ...

    def submit(self, var_vals: VarVals | None = None) -> Fence: ...

    async def submit_async(self, var_vals: VarVals | None = None) -> Fence: ...

    def __len__(self) -> int: ...
