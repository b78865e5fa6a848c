"""Opening devices by name, and cross-device transfers.

Theory of operation
-------------------
``open_devices("cpu:0", "cpu:1")`` is an async context manager that owns a
nursery: every queue actor of every device is a child of it, started with
``nursery.start``. Leaving the block

* normally: closes each queue's channel, so the actors drain what was queued
  and end on ``EndOfChannel``; engines finish and are joined; then signals and
  memory are released, and a fault nobody observed is raised;
* by an exception: marks the devices cancelled (engines skip what they have
  not started, breaking its signals), cancels the nursery, joins, releases, and
  re-raises the body's exception *unwrapped* (trio would wrap it in an
  ExceptionGroup if it escaped the nursery block, so it is caught inside and
  raised after).

A cancellation that reaches the close from outside (a deadline passing while the
block drains) cuts the drain short: what has not started is skipped. Either way,
before its memory is released, a device waits (shielded, within its hang limit)
for other devices' engines still reading or writing it -- a transfer queued on
another device -- so no engine ever touches unmapped memory.

A device whose wait already timed out at a caller (hung) is cancelled rather
than drained, and its timeout is not raised again.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import numpy as np
import trio

from hcqa import aio
from hcqa import commands as cmd
from hcqa.devices import backends
from hcqa.devices.base import Device
from hcqa.devices.buffer import Buffer
from hcqa.devices.capture import capturing as _capturing
from hcqa.devices.hostarrays import host_ref
from hcqa.devices.sizes import check_int
from hcqa.errors import HcqaError, InvalidCommand
from hcqa.signals import Fence, Signal

__all__ = ["open_device", "open_devices", "transfer"]


def _default_memory() -> int:
    try:
        return max(1 << 30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError):
        return 8 << 30


def _parse(spec: object) -> tuple[str, int, str]:
    """(kind, index, name) of a device spec (see ``backends.py``)."""
    return backends.parse_spec(spec)


def _make(spec: object, options: dict[str, Any], name: str | None = None) -> Device:
    kind, _, parsed = _parse(spec)
    name = name if name is not None else parsed
    return backends.device_class(kind, name)(name, **options)


_OPTIONS = {
    "hang_limit",
    "host_visible",
    "queue_depth",
    "memory",
    "timeline_start",
    "inline_kernels",
}


def _options(
    hang_limit: float = 30.0,
    host_visible: bool = True,
    queue_depth: int = 1024,
    memory: int | None = None,
    timeline_start: int = 0,
    inline_kernels: bool = False,
) -> dict[str, Any]:
    if isinstance(hang_limit, bool) or not isinstance(hang_limit, (int, float)):
        raise InvalidCommand(
            f"'hang_limit' must be a number of seconds (got {type(hang_limit).__name__})"
        )
    if not hang_limit > 0:
        raise InvalidCommand(f"'hang_limit' must be > 0 (got {hang_limit})")
    if not isinstance(host_visible, bool):
        raise InvalidCommand(f"'host_visible' must be a bool (got {type(host_visible).__name__})")
    if not isinstance(inline_kernels, bool):
        raise InvalidCommand(
            f"'inline_kernels' must be a bool (got {type(inline_kernels).__name__})"
        )
    check_int("queue_depth", queue_depth, minimum=1)
    check_int("timeline_start", timeline_start, minimum=0)
    if timeline_start >= 1 << 64:  # timeline values are unsigned 64-bit (then they wrap)
        raise InvalidCommand(f"'timeline_start' must be <= 2**64 - 1 (got {timeline_start})")
    if memory is None:
        memory = _default_memory()
    elif isinstance(memory, bool) or not isinstance(memory, int) or memory < 1:
        raise InvalidCommand(f"'memory' must be a positive number of bytes (got {memory!r})")
    return {
        "hang_limit": float(hang_limit),
        "host_visible": host_visible,
        "queue_depth": queue_depth,
        "memory": memory,
        "timeline_start": timeline_start,
        "inline_kernels": inline_kernels,
    }


@aio.rehosts
@asynccontextmanager
async def open_devices(*specs: str, **options: Any) -> AsyncIterator[tuple[Device, ...]]:
    """Open devices by spec (``"cpu:0"``, ``"opencl:0"``, ``"cpu:1"``); yields them as a tuple.

    Options: ``hang_limit`` (seconds, default 30), ``host_visible`` (default True),
    ``queue_depth`` (batches per queue channel, default 1024), ``memory`` (bytes),
    ``inline_kernels`` (default False: every kernel runs on its engine thread, so the
    event loop never runs one; True opts in to running a repeat call of a C kernel
    measured short -- at most 20 us, three times in a row -- on the caller's thread when
    its queue is idle: only for kernels whose time is known to be fixed, since one whose
    time depends on its data holds the event loop for a whole call when it turns long).
    Short copies (at most 1 MiB between memory that is not a file mapping) run on the
    caller's thread either way. Under asyncio the block is held by a trio task of the
    loop's host (see ``hcqa.aio``).
    """
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise InvalidCommand(
            f"open_devices() got unknown options {unknown} (expected some of {sorted(_OPTIONS)})"
        )
    opts = _options(**options)
    if not specs:
        raise InvalidCommand("open_devices() needs at least one device spec (got none)")
    names = _names(specs)  # every spec checked before anything is built
    made: list[Device] = []
    try:
        for s, name in zip(specs, names, strict=True):
            made.append(_make(s, opts, name))
    except BaseException:
        for d in made:
            d._release()
        raise
    devices = tuple(made)
    error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            for d in devices:
                await d._start(nursery)
            try:
                yield devices
            except BaseException as exc:
                error = exc
            with trio.CancelScope(shield=True):
                for d in devices:
                    if error is not None or d._hung:
                        d._cancel()
                    await d._close_input()
            if error is not None:
                nursery.cancel_scope.cancel()
    finally:
        # However the nursery ended (a cancellation from outside the block raises out of
        # it): other devices' engines may still read this memory; wait for them first.
        for d in devices:
            await d._wait_foreign()
        for d in devices:
            d._release()
    if error is not None:
        raise error
    unseen: list[BaseException] = []
    for d in devices:
        err = d._error
        fresh = isinstance(err, HcqaError) and not err.observed
        if fresh and err is not None and all(err is not u for u in unseen):
            err.observed = True  # type: ignore[attr-defined]
            unseen.append(err)
    if len(unseen) == 1:
        raise unseen[0]
    if unseen:
        raise ExceptionGroup("several devices faulted and nobody awaited it", unseen)  # type: ignore[type-var]


def _names(specs: tuple[str, ...]) -> list[str]:
    """The devices' names: the specs, with "#k" added to the k-th opening of a shared kind."""
    parsed = [_parse(s) for s in specs]
    names = [name for _, _, name in parsed]
    seen: dict[str, int] = {}
    for i, (kind, _, name) in enumerate(parsed):
        if backends.shared(kind):
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                names[i] = f"{name}#{seen[name]}"
    if len(set(names)) != len(names):
        raise InvalidCommand(f"each device may be opened once per call (got {names})")
    return names


@asynccontextmanager
async def open_device(spec: str, **options: Any) -> AsyncIterator[Device]:
    """Open one device; see :func:`open_devices` for the options."""
    async with open_devices(spec, **options) as (device,):
        yield device


def transfer(dest: Buffer, src: Buffer) -> Fence:
    """Copy ``src`` into ``dest`` (same size), across devices or within one.

    Copies bytes, never converts: as ``copyin`` does for a host array, two typed buffers
    must have the same dtype and shape (a raw buffer matches any of its size); to
    reinterpret on purpose, transfer a view (``src.view(0, src.nbytes, dtype=...)``).
    Runs on the destination's copy queue, after the source's last write and the
    destination's last uses; ordered on both devices' timelines. Returns the
    destination timeline's Fence. (A source in driver memory that the destination's
    kind can't read -- OpenCL to cpu -- is copied on the source's copy queue instead,
    and the Fence is the source timeline's, reached with the same batch. Between two kinds
    of driver memory -- cuda and opencl -- the bytes go through a host array: a copyout on
    the source's copy queue, then a copyin on the destination's once it is done.)"""
    for name, b in (("dest", dest), ("src", src)):
        if not isinstance(b, Buffer):
            raise InvalidCommand(
                f"transfer {name!r} must be a hcqa.Buffer (got {type(b).__name__})"
            )
        b._check()
    if dest.nbytes != src.nbytes:
        raise InvalidCommand(
            f"transfer needs equal sizes: dest has {dest.nbytes} bytes (got src of {src.nbytes})"
        )
    if dest.dtype is not None and src.dtype is not None:
        if src.dtype != dest.dtype:
            raise InvalidCommand(
                f"transfer: src dtype must be {dest.dtype}, dest's (got {src.dtype}); a "
                "transfer copies bytes and never converts: to reinterpret them, transfer "
                f"src.view(0, {src.nbytes}, dtype=...)"
            )
        if src.shape != dest.shape:
            raise InvalidCommand(
                f"transfer: src shape must be {dest.shape}, dest's (got {src.shape}); "
                f"to reshape, transfer src.view(0, {src.nbytes}, dtype=..., shape=...)"
            )
    device = dest.device
    if (
        not src.device.host_memory
        and not device.host_memory
        and type(device) is not type(src.device)
    ):
        return _through_host(dest, src)
    if not src.device.host_memory and type(device) is not type(src.device):
        device = src.device  # the destination can't read the source's memory: the source writes
    other = src.device if device is dest.device else dest.device
    also = (other,) if other is not device else ()
    command = cmd.Copy(dest=dest, src=src, nbytes=dest.nbytes)
    return device._submit(
        device.copy, [command], reads=[src], writes=[dest], also=also, waits=False
    )


def _through_host(dest: Buffer, src: Buffer) -> Fence:
    """Between two kinds of driver memory neither can address (cuda and opencl): the
    source's copy queue copies out into a host array, and the destination's copy queue
    waits for that on the loop, then copies it in. The destination timeline's Fence."""
    if _capturing.get() is not None:
        raise InvalidCommand(
            f"transfer from {src.device.name} to {dest.device.name} goes through host memory "
            "and can't be captured: capture a copyout and a copyin instead"
        )
    staging = np.empty(src.nbytes, np.uint8)
    first = src.device._copyout(src.view(0, src.nbytes), staging)
    host = host_ref(staging, dest.view(0, dest.nbytes), writable=False)
    wait = cmd.Wait(signal=cast("Signal", first.signal), value=first.value)
    copy = cmd.Copy(dest=dest, src=host, nbytes=dest.nbytes)
    device = dest.device
    return device._submit(device.copy, [wait, copy], writes=[dest], waits=True)
