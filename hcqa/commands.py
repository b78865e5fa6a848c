"""The commands a queue carries, as frozen attrs classes.

Theory of operation
-------------------
A command is plain data. The :class:`~hcqa.queue.Queue` builder validates it
and appends it to a batch; ``submit`` resolves every symbolic int (a
:class:`~hcqa.variables.Variable` or an expression) against ``var_vals`` and
sends the batch, as one message, to the queue's actor.

The actor handles :class:`Wait` itself (it awaits the signal, so a waiting
queue costs no CPU); everything else goes, in order, to the queue's engine
thread, which dispatches on the command's type through a table. The last
commands of every submitted batch are the internal :class:`Step` markers that
advance the queue's own signal and the device timeline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeAlias, TypeVar

import attrs

from hcqa.signals import Signal as _Signal
from hcqa.variables import IntLike


class ProgramRef(Protocol):
    """What a command names of a program (a :class:`~hcqa.devices.Program`): the commands
    sit below the devices and name their types only through these protocols."""

    name: str
    kernel: Any  # its C kernel (``CKernel``), or None
    device: Any  # its device (``Device``)

    def access(self, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]: ...


class BufferRef(Protocol):
    """What a command names of a buffer (a :class:`~hcqa.devices.Buffer`)."""

    device: Any
    nbytes: int
    va_addr: int


__all__ = [
    "Bind",
    "BufferRef",
    "Command",
    "Copy",
    "Exec",
    "Fused",
    "HostMemoryRef",
    "Load",
    "MemoryBarrier",
    "ProgramRef",
    "Signal",
    "Step",
    "Timestamp",
    "Wait",
]

Size3 = tuple[IntLike, IntLike, IntLike]
T = TypeVar("T")


@attrs.frozen(kw_only=True)
class Wait:
    """Hold the queue until ``signal.value >= value``."""

    signal: _Signal
    value: IntLike
    # False for a buffer hazard's wait on other queues' *reads* only (before a write):
    # work that the producer abandons (its device closed) then leaves nothing to wait for.
    after_write: bool = attrs.field(default=True, eq=False, repr=False)
    # A native lane's record of this command, cached on it (see ``hcqa/actors/lane.py``).
    native: Any = attrs.field(default=None, init=False, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Signal:
    """Set ``signal`` to ``value`` once every earlier command of the queue is done."""

    signal: _Signal
    value: IntLike
    native: Any = attrs.field(default=None, init=False, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Timestamp:
    """Write the engine's clock (ns, ``time.monotonic_ns``) into ``signal``'s timestamp slot."""

    signal: _Signal
    native: Any = attrs.field(default=None, init=False, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class MemoryBarrier:
    """Make earlier writes visible to later commands (a no-op for host memory)."""

    native: Any = attrs.field(default=None, init=False, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Exec:
    """Run ``program`` over ``buffers`` with int ``vals``."""

    program: ProgramRef
    buffers: tuple[BufferRef, ...]
    vals: tuple[IntLike, ...] = ()
    global_size: Size3 = (1, 1, 1)
    local_size: Size3 = (1, 1, 1)
    # For C kernels with concrete vals: the call's arguments (buffer addresses, then
    # vals), computed once at validation so the engine does no per-call packing.
    args: tuple[int, ...] | None = attrs.field(default=None, eq=False, repr=False)
    # ... and the call itself, ready to run (derived from ``args`` at every construction,
    # ``attrs.evolve`` included, so it can't go stale): the engine calls it directly.
    call: Callable[[], object] | None = attrs.field(init=False, eq=False, repr=False)
    # A repeat call whose kernel was measured short (see ``launch._Launch``): a device
    # may run it on the caller's thread when its queue is idle (``Device._inline``).
    inline: bool = attrs.field(default=False, eq=False, repr=False)
    native: Any = attrs.field(default=None, init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        args, kernel = self.args, self.program.kernel
        ready = None if args is None or kernel is None else functools.partial(kernel.fn, *args)
        object.__setattr__(self, "call", ready)


class Fused:
    """Base of a backend's fused command: several launches run as one call
    (``hcqa/devices/fusion.py``, whose ``FusedRun`` subclasses this; the actors name it
    through this base). ``names``: the kernels, in order; :meth:`access`: the buffers the
    run reads and writes -- what a batch that fails does not run, and the data it leaves
    unwritten (``actors/actor.py``, ``LOST``)."""

    __slots__ = ()

    names: tuple[str, ...]

    def access(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The buffers the run reads before it writes them, and those it writes."""
        raise NotImplementedError


@attrs.frozen(kw_only=True)
class HostMemoryRef:
    """Host memory outside any device (a numpy array or bytes given to copyin/copyout).

    ``keep`` holds the host object alive until the copy is done.
    """

    va_addr: int
    nbytes: int
    keep: Any = attrs.field(repr=False)


CopyEnd: TypeAlias = "BufferRef | HostMemoryRef"


@attrs.frozen(kw_only=True)
class Copy:
    """Copy ``nbytes`` from ``src`` to ``dest`` (buffers or host memory)."""

    dest: CopyEnd
    src: CopyEnd
    nbytes: IntLike
    native: Any = attrs.field(default=None, init=False, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Load:
    """Read ``nbytes`` of the file ``path`` from ``offset`` into ``dest`` (copy_from_disk)."""

    dest: BufferRef
    path: str
    offset: IntLike
    nbytes: IntLike
    native: Any = attrs.field(default=None, init=False, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Bind:
    """Internal: a graph replay's values of its variables, for the commands after it on
    this queue that kept their variables (a Python kernel's vals, patched in place: the
    engine resolves them from these values when it runs the kernel)."""

    values: Any = attrs.field(repr=False)  # {Variable or expression: int}
    native: Any = attrs.field(default=None, init=False, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Step:
    """Internal: everything before it completes step ``seq`` of a device timeline."""

    timeline: Any
    seq: int
    native: Any = attrs.field(default=None, init=False, eq=False, repr=False)


Command: TypeAlias = Wait | Signal | Timestamp | MemoryBarrier | Exec | Copy | Load | Step


def maker(cls: type[T]) -> Callable[..., T]:
    """A lean constructor of the frozen attrs class ``cls`` for the launch path: it takes
    *every* field, positionally in field order, and sets each slot directly -- no keyword
    parsing, no defaults, no post-init (the caller passes what ``__attrs_post_init__``
    would derive). Setting a slot through its descriptor costs a third of the generated
    ``__init__``'s ``object.__setattr__``; the instance is the same as one made by
    ``cls(...)`` with the same values."""
    names = [f.name for f in attrs.fields(cls)]  # type: ignore[arg-type]
    slots = {f"_set_{n}": cls.__dict__[n].__set__ for n in names}  # slotted: descriptors
    body = "".join(f"    _set_{n}(obj, {n})\n" for n in names)
    src = f"def make({', '.join(names)}):\n    obj = _new(_cls)\n{body}    return obj\n"
    scope: dict[str, Any] = {"_new": object.__new__, "_cls": cls, **slots}
    exec(src, scope)  # generated from the field names, as attrs does
    make: Callable[..., T] = scope["make"]
    make.__qualname__ = f"{cls.__name__}.make"
    return make
