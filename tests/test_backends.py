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

import attrs
import numpy as np
import pytest
import trio

import hcqa
from hcqa import commands as cmd
from hcqa.devices import backends
from hcqa.devices.base import Device
from hcqa.devices.fusion import FusedRun
from hcqa.devices.program import Program
from hcqa.errors import DeviceFault, InvalidCommand
from hcqa.variables import Variable

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


# -- the fusion seam: a backend's own fused runs, with no change in the graph code ----------------


@attrs.frozen(eq=False)
class PyRun(FusedRun):
    """SyncFusingDevice's fused command: its launches, run one after another by one handler;
    the values of its symbols travel with it (bound per replay)."""

    execs: tuple[Any, ...]
    names: tuple[str, ...]
    symbols: tuple[Any, ...]
    values: Any = None

    def buffers(self) -> tuple[Any, ...]:
        return tuple(dict.fromkeys(b for e in self.execs for b in e.buffers))

    def bound(self, values: Any, rebind: Any) -> PyRun:
        execs = self.execs
        if rebind:
            execs = tuple(
                attrs.evolve(e, buffers=tuple(rebind.get(b, b) for b in e.buffers)) for e in execs
            )
        return PyRun(
            execs=execs,
            names=self.names,
            symbols=self.symbols,
            values=self.values if values is None else dict(values),
        )


class SyncFusingDevice(SyncDevice):
    """A SyncDevice that fuses every run of Python launches into one PyRun."""

    kind = "syncfuse"
    fused: list[PyRun]  # every PyRun its executor ran

    def _executor(self, kind: str) -> SyncExecutor:
        executor = super()._executor(kind)
        executor._handlers[PyRun] = self._run
        self.fused = []
        return executor

    def _fusable(self, exec_: cmd.Exec) -> bool:
        return exec_.program.kernel is None

    def _fuse(self, run: Any) -> PyRun:
        symbols = {
            v: None for e in run for v in (*e.vals, *e.global_size, *e.local_size)
            if isinstance(v, Variable)
        }  # fmt: skip
        return PyRun(
            execs=tuple(run), names=tuple(e.program.name for e in run), symbols=tuple(symbols)
        )

    def _run(self, c: PyRun) -> None:
        self.fused.append(c)
        for e in c.execs:
            vals = [c.values[v] if isinstance(v, Variable) else v for v in e.vals]
            e.program.fn(*[b._kernel_array() for b in e.buffers], *vals)


@pytest.fixture
def fusing_backend() -> Iterator[None]:
    backends.register(
        "syncfuse", f"{__name__}:SyncFusingDevice", missing="the test backend is gone"
    )
    try:
        yield
    finally:
        del backends._BACKENDS["syncfuse"]


def _add_n(out: Any, inp: Any, n: int) -> None:
    np.add(inp, n, out=out)


async def test_a_backend_gets_fused_replays_by_implementing_the_seam(fusing_backend: None) -> None:
    """Three launches in a row become one PyRun in a graph and in a queue submitted again;
    replays bind a Variable through ``bound`` and rebind buffers through it too."""
    n = Variable("n", 0, 100)
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("syncfuse:0") as d:
            bufs = [d.alloc(shape=4, dtype=np.int64) for _ in range(4)]
            other = d.alloc(shape=4, dtype=np.int64)
            prog = d.program("addn", _add_n)
            await bufs[0].copyin(np.arange(4, dtype=np.int64))
            with hcqa.capture() as g:
                for i in range(3):
                    prog(bufs[i + 1], bufs[i], vals=(n,))
            assert g.statistics().native_runs == 1
            await g(n=2)
            out = np.empty(4, np.int64)
            await bufs[3].copyout(out)
            np.testing.assert_array_equal(out, np.arange(4) + 6)
            await g(n=5, buffers={bufs[3]: other})
            await other.copyout(out)
            np.testing.assert_array_equal(out, np.arange(4) + 15)
            assert [len(r.execs) for r in d.fused] == [3, 3]
            assert [r.values for r in d.fused] == [{n: 2}, {n: 5}]

            q = d.compute_queue()
            for i in range(3):
                q.exec(prog, (bufs[i + 1], bufs[i]), vals=(1,))
            await q.submit()
            await q.submit()  # a constant queue is sent fused from its second submit
            assert len(d.fused) == 3 and d.fused[-1].names == ("addn",) * 3
            await bufs[3].copyout(out)
            np.testing.assert_array_equal(out, np.arange(4) + 3)
