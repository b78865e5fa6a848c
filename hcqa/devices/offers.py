"""What a backend may offer: the fast paths, each off unless its Device turns it on.

Theory of operation
-------------------
A backend must provide memory, programs, executors and a clock (``base.py``, "what a backend
provides"). Beyond that it may offer fast paths; each is a class flag or a method here whose
default turns it off, and the core reaches it only through that flag or method -- the graph,
queue and actor code never names a backend, so a new backend gets a fast path by overriding
it here (docs/architecture.md, "The backend seam"):

* ``_fusable`` / ``_fuse`` -- runs of launches as one command (``fusion.py``);
* ``driver_waits`` / ``_driver_wait`` -- a Wait the driver keeps, instead of the host;
* ``_patches_in_place`` -- symbolic vals resolved at launch from the batch's ``Bind``, so a
  resubmit with new values sends its commands as built;
* ``_inline`` -- a lone short command run on the caller's thread;
* ``native_runner``, ``shares_native`` -- what an engine may call directly and what a
  program's launch record may hand to its repeat calls.

This is a mixin of :class:`~hcqa.devices.base.Device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from hcqa import commands as cmd

if TYPE_CHECKING:
    from hcqa.actors import QueueActor
    from hcqa.devices.fusion import FusedRun
    from hcqa.signals import Signal

__all__ = ["FastPaths"]


class FastPaths:
    """The fast paths a backend may offer, all off (see the module doc)."""

    # True where running a C kernel is exactly calling it on the host: engines then call an
    # Exec's ready native call directly.
    native_runner: ClassVar[bool] = False
    # True where what the executor caches on an Exec (``Exec.native``) describes the call
    # alone and keeps no memory alive (the cpu lane's records; OpenCL's, whose memory objects
    # are released explicitly): a program's launch record then hands it to its repeat calls
    # (``launch._Launch``), which a record keeping memory alive must not.
    shares_native: ClassVar[bool] = False
    # True where the driver can keep some Waits itself (``_driver_wait``): the queue actors
    # then ask before they await one on the host.
    driver_waits: ClassVar[bool] = False

    def _driver_wait(self, actor: QueueActor, signal: Signal, value: int) -> Any:
        """A fast path a backend may offer (with ``driver_waits = True``): what to hand
        ``actor``'s executor in the place of ``Wait(signal, value)`` so that its driver
        holds the commands after it until ``signal >= value`` -- ordering work the driver
        already has, with the same semantics and fault crossing as the host's wait -- or
        None: the actor awaits the signal on the host (signals produced elsewhere: the host,
        another process, another driver). None by default."""
        return None

    def _inline(self, command: Any) -> bool:
        """Whether ``command``, alone in a batch on an idle queue with no hazard, may run
        inline on the caller's thread (see ``actor.py``): only what surely takes a few
        tens of microseconds. None by default."""
        return False

    def _patches_in_place(self, exec_: cmd.Exec) -> bool:
        """Whether this device's executor resolves ``exec_``'s symbolic vals itself, at
        launch, from the ``Bind`` its batch starts with (``commands.Bind``): a queue or
        graph submitted with new values then sends its commands as built, with one
        ``Bind`` (``_graph/patch.py``, ``CommandSlot``), instead of a new command per
        launch. By default a Python kernel's (the cpu engine resolves them); typed vals
        are still range-checked at submit, once per value."""
        return exec_.program.kernel is None and getattr(exec_.program, "val_ranges", 1) is None

    def _fusable(self, exec_: cmd.Exec) -> bool:
        """Whether ``exec_`` may join a fused run (``fusion.py``): graphs and queues
        submitted again then send each run of such launches as one command, made by
        :meth:`_fuse`. None by default."""
        return False

    def _fuse(self, run: Sequence[cmd.Exec]) -> FusedRun:
        """One command that runs every launch of ``run`` (two or more, each
        :meth:`_fusable`, in a row on one queue), in order: a
        :class:`~hcqa.devices.fusion.FusedRun` this device's executor runs. Called on the
        caller's task (a capture's end, a queue's submit): compile nothing here."""
        raise NotImplementedError
