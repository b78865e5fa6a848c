"""Fences: points on a timeline.

Theory of operation
-------------------
A :class:`Fence` is a signal and a value: it is reached once ``signal.value >=
value``. Every enqueue returns one. Devices hand out fences that also carry their
hang limit, a description for error messages and the device itself, so that a wait
with no progress raises :class:`~hcqa.errors.SignalTimeout` naming where it was stuck
and marks the device hung. A fence never owns its signal.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

import attrs
import trio

from hcqa.errors import SignalTimeout

__all__ = ["Fence", "SignalRef"]

_checkpoint = trio.lowlevel.checkpoint
_in_trio_task = trio.lowlevel.in_trio_task


class SignalRef(Protocol):
    """A :class:`~hcqa.signals.Signal` as a fence sees it (its public surface and the limited
    wait): ``hcqa.signals`` builds on this module, so it names the Signal through this."""

    name: str
    _failed: dict[int, BaseException]

    @property
    def value(self) -> int: ...

    @property
    def timestamp(self) -> float: ...

    async def wait(self, value: int) -> None: ...

    def wait_sync(self, value: int, timeout: float | None = None) -> None: ...

    def statistics(self) -> Any: ...

    async def _wait_limited(
        self, target: int, hang_limit: float | None, context: str, *, observe: bool = True
    ) -> None: ...


@attrs.frozen(eq=False)
class Fence:
    """A point on a timeline: ``signal`` reaching ``value``.

    ``await fence`` waits for it; ``fence.wait_sync(timeout=...)`` blocks a thread;
    ``fence.reached`` tells without waiting (a step whose batch failed alone is reached;
waiting on it raises that batch's error). Devices hand out fences that also
    carry their hang limit and a description used in error messages.
    """

    signal: SignalRef  # a hcqa.Signal
    value: int
    hang_limit: float | None = attrs.field(default=None, kw_only=True)
    context: str = attrs.field(default="", kw_only=True)
    device: Any = attrs.field(default=None, kw_only=True, repr=False)

    @property
    def reached(self) -> bool:
        """True once ``signal.value >= value`` (never blocks)."""
        return self.signal.value >= self.value

    async def wait(self) -> None:
        """Wait for the fence (same as ``await fence``); raises SignalTimeout past the
        device's hang limit with no progress, or the device's fault."""
        try:
            await self.signal._wait_limited(self.value, self.hang_limit, self.context)
        except SignalTimeout as exc:
            exc.observed = True
            if self.device is not None:
                self.device._hang(exc)
            raise
        failed = self.signal._failed
        if failed and self.value in failed:  # the step's batch failed alone
            raise failed[self.value]

    def __await__(self) -> Generator[Any, None, None]:
        """``await fence``: see :meth:`wait`."""
        # A fence already reached, awaited from trio, is exactly a checkpoint (what wait
        # comes to), without wait's frames.
        sig = self.signal
        if sig.value >= self.value and not sig._failed and _in_trio_task():
            return _checkpoint().__await__()
        return self.wait().__await__()

    def wait_sync(self, timeout: float | None = None) -> None:
        """Block this (non-trio) thread until the fence is reached; SignalTimeout after
        ``timeout`` seconds."""
        self.signal.wait_sync(self.value, timeout)
        failed = self.signal._failed
        if failed and self.value in failed:
            raise failed[self.value]

    def __repr__(self) -> str:
        state = "reached" if self.reached else f"at {self.signal.value}"
        return f"<Fence {self.signal.name}>={self.value} ({state})>"
