"""The errors hcqa raises.

Every error is an :class:`HcqaError`; bad arguments of any kind are
:class:`InvalidCommand` (also a ``ValueError`` and a ``TypeError``). Messages say
what was expected and what was seen, in the form ``'value' must be >= 5 (got 3)``.

``DeviceFault`` carries one extra piece of state: whether it has been *observed*,
that is raised to some caller. A fault that nobody saw is raised when its device
closes; one that was already raised is not raised again (see DESIGN.md).
"""

from __future__ import annotations

from contextvars import ContextVar

__all__ = [
    "DeviceClosed",
    "DeviceFault",
    "HcqaError",
    "InvalidCommand",
    "OutOfMemory",
    "QueueFull",
    "SignalTimeout",
    "install_hint",
    "work_owner",
]

work_owner: ContextVar[object | None] = ContextVar("hcqa_work_owner", default=None)
"""Who the work a task queues belongs to (any object; None: nobody in particular). A device
notes it for each batch queued while it is set, and a :class:`DeviceFault` raised by a
kernel or copy of that batch names it as its ``owner`` (``hcqa.serve`` sets it per run, so
only the request whose own work faulted is blamed)."""


def install_hint(extra: str) -> str:
    """How to add an optional extra, for messages: hcqa is installed from its repository
    checkout (it is on no package index), so from there: ``pip install -e '.[serve]'``."""
    return f"pip install -e '.[{extra}]' in the hcqa checkout"


class HcqaError(Exception):
    """Base class of every error hcqa raises on purpose.

    ``observed`` turns True once the error has been raised to a caller; a device
    raises an unobserved fault when it closes, and an observed one never again.
    """

    observed: bool = False


class SignalTimeout(HcqaError):
    """A wait saw no progress for longer than its limit.

    ``signal`` is the signal's name, ``expected`` the awaited value and ``seen``
    the value it had when the wait gave up.
    """

    def __init__(
        self,
        message: str,
        *,
        signal: str = "",
        expected: int = 0,
        seen: int = 0,
        device: str = "",
        queue: str = "",
    ) -> None:
        super().__init__(message)
        self.signal = signal
        self.expected = expected
        self.seen = seen
        self.device = device
        self.queue = queue


class DeviceFault(HcqaError):
    """A kernel or a copy failed on a device; the original error is ``__cause__``.

    Sticky: once a device has faulted, every later wait on its timeline raises the
    same instance. ``owner``: the :data:`work_owner` of the batch whose command failed,
    when the device could tell (None: unknown, or queued with no owner set).
    """

    def __init__(self, message: str, *, device: str = "", queue: str = "") -> None:
        super().__init__(message)
        self.device = device
        self.queue = queue
        self.owner: object | None = None


class InvalidCommand(HcqaError, ValueError, TypeError):
    """Bad arguments, raised at enqueue before anything was queued.

    Every argument hcqa refuses -- a wrong value *or* a wrong type (a str where an int
    belongs, a misspelled dtype) -- raises this one class. It is also a ``ValueError``
    and a ``TypeError``, so ``except ValueError`` and ``except TypeError`` catch it too.
    The only ``TypeError`` s that are not hcqa's are Python's own: a call with a wrong
    number of positional arguments or an unknown keyword, an operator between a
    Variable and a float."""


class OutOfMemory(HcqaError, MemoryError):
    """An allocation does not fit in what the device has left."""


class QueueFull(HcqaError):
    """A synchronous submit found the queue's channel full (use the async submit)."""


class DeviceClosed(HcqaError):
    """The device was closed; nothing more can be queued on it."""


def sole_error(exc: BaseException) -> BaseException:
    """``exc`` without the exception groups that wrap just one error (as a nursery wraps
    the one failure of its children)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
