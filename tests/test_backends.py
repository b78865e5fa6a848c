"""The backend seam: a backend registered from outside hcqa opens, computes, copies, faults
and closes with no change in the core.

``SyncDevice`` below is a complete backend in the few lines the seam asks for: it is
registered by dotted path (``hcqa.devices.backends.register``), builds Python programs, and
brings its own executor -- not an engine thread: it executes each run on the caller's thread
as ``put`` hands it over -- which reports completion through signals only.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio

import hcqa
from hcqa import commands as cmd
from hcqa.devices import backends
from hcqa.devices.base import Device
from hcqa.devices.program import Program
from hcqa.errors import DeviceFault, InvalidCommand

TIMEOUT = 30


class SyncExecutor:
    """An executor that runs each run as it is put, on the putting thread."""

    def __init__(
        self, name: str, handlers: dict[type, Callable[[Any], None]], on_fault: Any
    ) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.timeline: Any = None
        self.exited = hcqa.Signal(name=f"{name} exit")
        self.runs = 0
        self._on_fault = on_fault
        self._handlers: dict[type, Callable[[Any], None]] = {
            cmd.Signal: lambda c: c.signal._set_from_engine(c.value),
            cmd.Timestamp: lambda c: c.signal._stamp_from_engine(time.monotonic_ns()),
            cmd.MemoryBarrier: lambda c: None,
            cmd.Step: lambda c: c.timeline.complete(c.seq),
            **handlers,
        }

    def start(self) -> None:
        pass

    def put(self, run: list[Any] | None) -> None:
        if run is None:
            self.exited._set_from_engine(1)
            return
        self.runs += 1
        for c in run:
            if self.error is not None:
                self._skip(c)
                continue
            try:
                self._handlers[type(c)](c)
            except BaseException as exc:
                self._on_fault(c, exc)
                self._skip(c)

    def _skip(self, c: Any) -> None:
        if type(c) is cmd.Signal:
            c.signal._break(self.error)
        elif type(c) is cmd.Step and c.timeline is not self.timeline:
            c.timeline.complete(c.seq)

    def run_inline(self, run: list[Any]) -> None:
        self.put(run)

    def stop(self) -> None:
        self.put(None)

    def join(self, timeout: float | None = None) -> bool:
        return True

    @property
    def alive(self) -> bool:
        return False


class SyncDevice(Device):
    """Host memory; Python kernels and copies executed by a SyncExecutor."""

    kind = "sync"

    def _executor(self, kind: str) -> SyncExecutor:
        if kind == "compute":
            handlers: dict[type, Callable[[Any], None]] = {cmd.Exec: self._exec}
        else:
            handlers = {cmd.Copy: self._copy}
        return SyncExecutor(
            f"{self.name} {kind}",
            handlers,
            lambda c, exc: self._on_engine_fault(kind, c, exc),
        )

    def _make_program(self, name: str, src: Any, **options: Any) -> Program:
        if not callable(src):
            raise InvalidCommand(f"a sync device runs Python callables (got {type(src).__name__})")
        return Program(self, name, fn=src, writes=options["writes"], reads=options["reads"])

    @staticmethod
    def _exec(c: Any) -> None:
        c.program.fn(*[b._kernel_array() for b in c.buffers], *c.vals)

    @staticmethod
    def _copy(c: Any) -> None:
        ctypes.memmove(c.dest.va_addr, c.src.va_addr, c.nbytes)


@pytest.fixture
def sync_backend() -> Iterator[None]:
    backends.register("sync", f"{__name__}:SyncDevice", missing="the test backend is gone")
    try:
        yield
    finally:
        del backends._BACKENDS["sync"]


def _add_one(out: Any, inp: Any) -> None:
    np.add(inp, 1, out=out)


async def test_a_registered_backend_with_its_own_executor_computes_and_copies(
    sync_backend: None,
) -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_devices("sync:0", "cpu:0") as (s, c):
            assert type(s) is SyncDevice and s.name == "sync:0"
            x = np.arange(8, dtype=np.float32)
            a, b = s.alloc(shape=8, dtype=np.float32), s.alloc(shape=8, dtype=np.float32)
            await a.copyin(x)
            await s.program("add1", _add_one)(b, a)
            on_cpu = c.alloc(shape=8, dtype=np.float32)
            await hcqa.transfer(on_cpu, b)  # across backends, ordered on both timelines
            y = np.empty(8, np.float32)
            await on_cpu.copyout(y)
            np.testing.assert_array_equal(y, x + 1)
            await s.synchronize()
            assert s.compute.engine.runs >= 1  # the launch went through the backend's executor
            assert s.timeline.value == s.statistics().timeline_reserved


async def test_a_backend_executor_reports_a_failing_kernel_as_a_sticky_fault(
    sync_backend: None,
) -> None:
    def bad(out: Any) -> None:
        raise ValueError("kernel broke")

    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("sync:0") as s:
            buf = s.alloc(64)
            fence = s.program("bad", bad)(buf)
            with pytest.raises(DeviceFault, match="'bad'") as caught:
                await fence
            assert isinstance(caught.value.__cause__, ValueError)
            assert s.faulted is caught.value
            with pytest.raises(DeviceFault) as again:
                s.program("bad", bad)(buf)  # sticky: refused at the next enqueue
            assert again.value is caught.value


def test_specs_name_every_registered_kind(sync_backend: None) -> None:
    assert backends.parse_spec(" sync:03 ") == ("sync", 3, "sync:3")
    with pytest.raises(InvalidCommand, match=r"'cpu:N' or 'cuda:N'.* or 'sync:N' \(got 'gpu:0'\)"):
        backends.parse_spec("gpu:0")
    with pytest.raises(InvalidCommand, match="did you mean 'sync:0'"):
        backends.parse_spec("sync")


async def test_a_backend_that_cannot_be_imported_is_refused_with_its_hint() -> None:
    backends.register("nope", "hcqa.devices.no_such_backend:NopeDevice", missing="install nope")
    try:
        with pytest.raises(InvalidCommand, match=r"^nope:0: install nope \(No module named"):
            async with hcqa.open_device("nope:0"):
                pass
    finally:
        del backends._BACKENDS["nope"]


@pytest.mark.parametrize(
    ("kind", "target", "expected"),
    [
        ("Sync", "m:C", "backend kind must be a lowercase identifier (got 'Sync')"),
        ("sync", "m.C", "backend target must look like 'package.module:Class' (got 'm.C')"),
    ],
)
def test_register_refuses_bad_entries(kind: str, target: str, expected: str) -> None:
    with pytest.raises(InvalidCommand, match=expected.replace("(", r"\(").replace(")", r"\)")):
        backends.register(kind, target, missing="-")
