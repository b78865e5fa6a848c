"""The bad-input matrix: every public entry point, given wrong types, sizes, devices, dtypes,
negative or oversized values, closed devices and variables out of range.

Each case must raise ``InvalidCommand``, ``TypeError`` or ``DeviceClosed`` (``OutOfMemory`` for
an allocation too large to fit) with a message that says what was expected and what was seen;
and afterwards nothing is queued (device statistics, queue lengths, buffer hazards unchanged)
and no buffer is changed.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing

import hcqa
import hcqa.testing as ht
from hcqa import (
    DeviceClosed,
    InvalidCommand,
    OutOfMemory,
    Signal,
    Variable,
)

N = 16
SAFE = 30.0
ADD1 = """
void add1(float *out, const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + 1.0f;
}
"""


def _two(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
    out[:] = a


@attrs.define
class Env:
    """Two open devices, a closed one, and things made on each, before any bad call."""

    d0: hcqa.Device
    d1: hcqa.Device
    dc: hcqa.Device  # closed
    a: hcqa.Buffer  # float32[N] on d0
    b: hcqa.Buffer  # float32[N] on d0
    raw: hcqa.Buffer  # 64 bytes on d0
    big: hcqa.Buffer  # float32[2N] on d0
    other: hcqa.Buffer  # float32[N] on d1
    busy: hcqa.Buffer  # 8 bytes on d0, written by queued work that waits on `hold`
    freed: hcqa.Buffer  # freed on d0
    py: hcqa.Program  # _two on d0
    c: hcqa.Program  # add1 on d0
    c1: hcqa.Program  # add1 on d1
    q: hcqa.Queue  # d0 compute queue, one exec
    qc: hcqa.Queue  # d0 copy queue, one copy
    n: Variable  # [1, N]
    qv: hcqa.Queue  # d0 compute queue with variables: exec add1 (vals n), signal s (n - 1)
    g: hcqa.Graph  # c(b, a, vals=(n,)) then transfer(other, b)
    empty: hcqa.Graph
    s: Signal
    hold: Signal
    gone: Signal  # closed
    path: Path  # 64 bytes
    ca: hcqa.Buffer  # on the closed device
    cprog: hcqa.Program
    cq: hcqa.Queue
    cg: hcqa.Graph

    @property
    def checked(self) -> tuple[hcqa.Buffer, ...]:
        return (self.a, self.b, self.raw, self.big, self.other)

    @property
    def queues(self) -> tuple[hcqa.Queue, ...]:
        return (self.q, self.qc, self.qv, self.cq)


@asynccontextmanager
async def environment(tmp_path: Path) -> AsyncIterator[Env]:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(64)))
    n = Variable("n", 1, N)
    s, hold, gone = Signal(name="s"), Signal(name="hold"), Signal(name="gone")
    gone.close()
    async with hcqa.open_device("cpu:2", hang_limit=SAFE) as dc:
        ca = dc.alloc(shape=(N,), dtype="float32")
        cprog = dc.program("add1", ADD1)
        cq = dc.compute_queue().exec(cprog, (ca, ca), vals=(N,))
        with hcqa.capture() as cg:
            cprog(ca, ca, vals=(n,))
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=SAFE) as (d0, d1):
        a, b = (d0.alloc(shape=(N,), dtype="float32") for _ in range(2))
        raw = d0.alloc(64)
        big = d0.alloc(shape=(2 * N,), dtype="float32")
        other = d1.alloc(shape=(N,), dtype="float32")
        rng = np.random.default_rng(0)
        for buf in (a, b, big, other):
            assert buf.shape is not None
            await buf.copyin(rng.standard_normal(buf.shape).astype(np.float32))
        await raw.copyin(bytes(range(64)))
        freed = d0.alloc(8)
        freed.free()
        py, c, c1 = d0.program("two", _two), d0.program("add1", ADD1), d1.program("add1", ADD1)
        busy = d0.alloc(8)
        d0.compute_queue().wait(hold, 1).exec(d0.program("c", lambda out: None), (busy,)).submit()
        q = d0.compute_queue().exec(c, (b, a), vals=(N,))
        qc = d0.copy_queue().copy(b, a, a.nbytes)
        qv = d0.compute_queue().exec(c, (b, a), vals=(n,)).signal(s, n - 1)
        with hcqa.capture() as g:
            c(b, a, vals=(n,))
            hcqa.transfer(other, b)
        with hcqa.capture() as empty:
            pass
        await trio.testing.wait_all_tasks_blocked()
        env = Env(
            d0=d0,
            d1=d1,
            dc=dc,
            a=a,
            b=b,
            raw=raw,
            big=big,
            other=other,
            busy=busy,
            freed=freed,
            py=py,
            c=c,
            c1=c1,
            q=q,
            qc=qc,
            n=n,
            qv=qv,
            g=g,
            empty=empty,
            s=s,
            hold=hold,
            gone=gone,
            path=path,
            ca=ca,
            cprog=cprog,
            cq=cq,
            cg=cg,
        )
        try:
            yield env
        finally:
            hold.value = 1  # let the held work drain
    s.close()
    hold.close()


def _snapshot(env: Env) -> Any:
    hazards = []
    for buf in (*env.checked, env.busy):
        hz = buf._hazards
        hazards.append((hz.write, dict(hz.reads)))
    return (
        [d.statistics() for d in (env.d0, env.d1, env.dc)],
        [len(q) for q in env.queues],
        [(list(q._reads), list(q._writes)) for q in env.queues],
        [g.statistics() for g in (env.g, env.cg)],
        hazards,
        env.s.value,
    )


def _contents(env: Env) -> list[bytes]:
    return [bytes(buf.numpy_view().view(np.uint8)) for buf in env.checked]


async def _enter(cm: AbstractAsyncContextManager[Any]) -> None:
    async with cm:
        pass


@attrs.frozen
class Case:
    id: str
    call: Callable[[Env], Any]
    error: type[BaseException] | tuple[type[BaseException], ...]
    match: str  # a regex the message must contain
    shows_seen: bool = True  # the message says what it got


def _cases() -> list[Any]:
    o, C = hcqa.open_devices, Case
    _NO_CUDA = r"CUDA (driver|backend)|cuda:99 does not exist"
    # hcqa refuses every bad argument with InvalidCommand; TypeError only from Python itself
    ic, py_te, dc_ = InvalidCommand, TypeError, DeviceClosed
    f32 = np.float32
    cases = [
        # -- open_device / open_devices --------------------------------------------------
        C("open-spec-int", lambda e: _enter(o(0)), ic, "device spec must be a str"),  # type: ignore[arg-type]
        C("open-spec-bad", lambda e: _enter(o("gpu:0")), ic, "must look like 'cpu:N'"),
        C("open-spec-index", lambda e: _enter(o("cpu:-1")), ic, "must look like"),
        C("open-device-bad", lambda e: _enter(hcqa.open_device("cpu0")), ic, "must look like"),
        C("open-no-spec", lambda e: _enter(o()), ic, "at least one device spec"),
        C("open-duplicate", lambda e: _enter(o("cpu:5", "cpu:5")), ic, "once per call"),
        C("open-cuda", lambda e: _enter(o("cuda:99")), ic, _NO_CUDA, False),
        C("hang-str", lambda e: _enter(o("cpu:5", hang_limit="1")), ic, "'hang_limit'"),
        C("hang-bool", lambda e: _enter(o("cpu:5", hang_limit=True)), ic, "'hang_limit'"),
        C("hang-zero", lambda e: _enter(o("cpu:5", hang_limit=0)), ic, r"'hang_limit' must be > 0"),
        C("hang-neg", lambda e: _enter(o("cpu:5", hang_limit=-1.0)), ic, "'hang_limit'"),
        C("hang-nan", lambda e: _enter(o("cpu:5", hang_limit=float("nan"))), ic, "'hang_limit'"),
        C("host-visible-int", lambda e: _enter(o("cpu:5", host_visible=1)), ic, "'host_visible'"),
        C("depth-zero", lambda e: _enter(o("cpu:5", queue_depth=0)), ic, "'queue_depth'"),
        C("depth-str", lambda e: _enter(o("cpu:5", queue_depth="8")), ic, "'queue_depth'"),
        C("start-neg", lambda e: _enter(o("cpu:5", timeline_start=-1)), ic, "'timeline_start'"),
        C("start-float", lambda e: _enter(o("cpu:5", timeline_start=1.5)), ic, "'timeline_start'"),
        C("memory-zero", lambda e: _enter(o("cpu:5", memory=0)), ic, "'memory'"),
        C("memory-str", lambda e: _enter(o("cpu:5", memory="1G")), ic, "'memory'"),
        C("open-unknown-option", lambda e: _enter(o("cpu:5", colour=1)), ic, "colour", False),
        # -- alloc -------------------------------------------------------------------------
        C("alloc-zero", lambda e: e.d0.alloc(0), ic, r"'nbytes' must be >= 1 \(got 0\)"),
        C("alloc-neg", lambda e: e.d0.alloc(-8), ic, r"'nbytes' must be >= 1"),
        C("alloc-float", lambda e: e.d0.alloc(8.0), ic, r"'nbytes' must be an int"),  # type: ignore[arg-type]
        C("alloc-bool", lambda e: e.d0.alloc(True), ic, r"'nbytes' must be an int"),
        C("alloc-str", lambda e: e.d0.alloc("8"), ic, r"'nbytes' must be an int"),  # type: ignore[arg-type]
        C("alloc-huge", lambda e: e.d0.alloc(1 << 62), OutOfMemory, "out of memory", False),
        C("alloc-nothing", lambda e: e.d0.alloc(), ic, "needs 'nbytes' or 'shape'"),
        C("alloc-shape-no-dtype", lambda e: e.d0.alloc(shape=(4,)), ic, "needs a 'dtype'"),
        C("alloc-shape-zero", lambda e: e.d0.alloc(shape=(0,), dtype=f32), ic, "positive ints"),
        C("alloc-shape-neg", lambda e: e.d0.alloc(shape=(2, -1), dtype=f32), ic, "positive"),
        C("alloc-shape-bool", lambda e: e.d0.alloc(shape=True, dtype=f32), ic, "'shape'"),
        C("alloc-shape-float", lambda e: e.d0.alloc(shape=(2.0,), dtype=f32), ic, "'shape'"),  # type: ignore[arg-type]
        C("alloc-dtype-bad", lambda e: e.d0.alloc(8, dtype="float33"), ic, "'dtype'"),
        C("alloc-dtype-object", lambda e: e.d0.alloc(8, dtype=object), ic, "'dtype'"),
        C("alloc-size-mismatch", lambda e: e.d0.alloc(8, shape=(3,), dtype=f32), ic, "'nbytes'"),
        C("alloc-not-multiple", lambda e: e.d0.alloc(6, dtype=f32), ic, "multiple of"),
        # -- program() ---------------------------------------------------------------------
        C("program-name-empty", lambda e: e.d0.program("", _two), ic, "'name'"),
        C("program-name-int", lambda e: e.d0.program(3, _two), ic, "'name'"),  # type: ignore[arg-type]
        C("program-src-int", lambda e: e.d0.program("p", 42), ic, "callable or C source"),
        C("program-entry-py", lambda e: e.d0.program("p", _two, entry="x"), ic, "'entry'"),
        C(
            "program-float-scalar",
            lambda e: e.d0.program("f", "void f(float *o, float x) {}"),
            ic,
            "floating-point scalar",
            False,
        ),
        C("program-writes-neg", lambda e: e.d0.program("p", _two, writes=(-1,)), ic, "'writes'"),
        C("program-writes-str", lambda e: e.d0.program("p", _two, writes=("a",)), ic, "'writes'"),  # type: ignore[arg-type]
        C("program-writes-c", lambda e: e.d0.program("add1", ADD1, writes=(5,)), ic, "< 2"),
        C("program-async-src", lambda e: e.d0.program_async("p", 42), ic, "callable or C source"),
        C("program-async-flag", lambda e: e.d0.program_async("k", ADD1, flags=("",)), ic, "flags"),
        # -- calling a program ---------------------------------------------------------------
        C("call-not-buffer", lambda e: e.py(np.zeros(N, f32), e.a), ic, "hcqa.Buffer"),  # type: ignore[arg-type]
        C("call-other-device", lambda e: e.py(e.b, e.other), ic, "must be on cpu:0"),
        C("call-c-buffers", lambda e: e.c(e.b, vals=(N,)), ic, "takes 2 buffers and 1 vals"),
        C("call-c-vals", lambda e: e.c(e.b, e.a), ic, "takes 2 buffers and 1 vals"),
        C("call-val-float", lambda e: e.c(e.b, e.a, vals=(1.0,)), ic, "val 0 must be an int"),  # type: ignore[arg-type]
        C("call-val-bool", lambda e: e.c(e.b, e.a, vals=(True,)), ic, "val 0 must be an int"),
        C("call-val-big", lambda e: e.c(e.b, e.a, vals=(2**31,)), ic, r"must be in \["),
        C("call-val-small", lambda e: e.c(e.b, e.a, vals=(-(2**31) - 1,)), ic, r"must be in \["),
        C("call-vals-int", lambda e: e.c(e.b, e.a, vals=N), ic, "'vals' must be a tuple"),  # type: ignore[arg-type]
        C("call-global-zero", lambda e: e.py(e.b, e.a, global_size=(0, 1, 1)), ic, "global_size"),
        C("call-global-4d", lambda e: e.py(e.b, e.a, global_size=(1, 1, 1, 1)), ic, "global"),
        C("call-global-str", lambda e: e.py(e.b, e.a, global_size="x"), ic, "global_size"),  # type: ignore[arg-type]
        C("call-global-float", lambda e: e.py(e.b, e.a, global_size=(1.5,)), ic, "global"),  # type: ignore[arg-type]
        C("call-local-neg", lambda e: e.py(e.b, e.a, local_size=(-1,)), ic, "local_size"),
        C("call-py-arity", lambda e: e.py(e.b), ic, "takes 2 arguments"),
        C("call-unbound-var", lambda e: e.c(e.b, e.a, vals=(e.n,)), ic, "unbound outside", False),
        C("call-freed", lambda e: e.py(e.freed, e.a), ic, "was freed", False),
        C(
            "call-declared-writes",
            lambda e: e.d0.program("w", _two, writes=(3,))(e.b, e.a),
            ic,
            "position 3",
            False,
        ),
        C("timed-other-device", lambda e: e.c.timed(e.other, e.a, vals=(N,)), ic, "cpu:0"),
        # -- buffers: views, copies, loads, free -----------------------------------------------
        C("view-neg-offset", lambda e: e.raw.view(-1, 8), ic, "'offset' must be >= 0"),
        C("view-zero", lambda e: e.raw.view(0, 0), ic, "'nbytes' must be >= 1"),
        C("view-past-end", lambda e: e.raw.view(60, 8), ic, "must lie within"),
        C("view-offset-str", lambda e: e.raw.view("1", 8), ic, "'offset' must be an int"),  # type: ignore[arg-type]
        C("view-shape-mismatch", lambda e: e.raw.view(0, 8, dtype=f32, shape=(3,)), ic, "'nbytes'"),
        C("copyin-list", lambda e: e.a.copyin([0.0] * N), ic, "numpy array"),
        C("copyin-dtype", lambda e: e.a.copyin(np.zeros(N, np.float64)), ic, "dtype must be"),
        C("copyin-size", lambda e: e.a.copyin(np.zeros(N + 1, f32)), ic, "must be 64 bytes"),
        C("copyin-bytes-size", lambda e: e.raw.copyin(bytes(63)), ic, "must be 64 bytes"),
        C("copyout-readonly", lambda e: e.a.copyout(_readonly(N)), ic, "writable"),
        C("copyout-bytes", lambda e: e.raw.copyout(bytes(64)), ic, "writable"),
        C("copyout-strided", lambda e: e.a.copyout(np.zeros(2 * N, f32)[::2]), ic, "contiguous"),
        C("copyout-size", lambda e: e.a.copyout(np.zeros(N - 1, f32)), ic, "must be 64 bytes"),
        C(
            "load-missing",
            lambda e: e.raw.load(e.path.with_name("nope")),
            ic,
            "must be a readable file",
        ),
        C("load-neg-offset", lambda e: e.raw.load(e.path, offset=-1), ic, "'offset'"),
        C("load-too-long", lambda e: e.raw.load(e.path, nbytes=65), ic, "'nbytes' must be <="),
        C("load-zero", lambda e: e.raw.load(e.path, nbytes=0), ic, "'nbytes' must be >= 1"),
        C("load-short-file", lambda e: e.raw.load(e.path, offset=8), ic, "must hold"),
        C("load-path-int", lambda e: e.raw.load(3), ic, "'path' must be a str or os.PathLike"),  # type: ignore[arg-type]
        C("free-view", lambda e: e.raw.view(0, 8).free(), ic, "owning buffer", False),
        C("free-busy", lambda e: e.busy.free(), ic, "still used by queued work", False),
        # -- transfer ---------------------------------------------------------------------------
        C("transfer-dest-array", lambda e: hcqa.transfer(np.zeros(N, f32), e.a), ic, "'dest'"),  # type: ignore[arg-type]
        C("transfer-src-array", lambda e: hcqa.transfer(e.other, b"x" * 64), ic, "'src'"),  # type: ignore[arg-type]
        C("transfer-size", lambda e: hcqa.transfer(e.other, e.big), ic, "equal sizes"),
        C("transfer-freed", lambda e: hcqa.transfer(e.freed, e.raw.view(0, 8)), ic, "freed", False),
        C("copyin-object", lambda e: e.raw.copyin(np.empty(8, object)), ic, "non-object dtype"),
        C("copyout-object", lambda e: e.raw.copyout(np.empty(8, object)), ic, "non-object dtype"),
        C(
            "copyout-struct-object",
            lambda e: e.raw.copyout(np.empty(4, [("a", "f8"), ("o", object)])),
            ic,
            "non-object dtype",
        ),
        C(
            "copyin-memoryview-object",
            lambda e: e.raw.copyin(memoryview(np.empty(8, object))),
            ic,
            "plain data",
        ),
        C(
            "copyin-structured",
            lambda e: e.a.copyin(np.zeros(N, [("x", "f2"), ("y", "f2")])),
            ic,
            "dtype must be float32",
        ),
        C("copyin-shape", lambda e: e.a.copyin(np.zeros((2, N // 2), f32)), ic, r"shape must be"),
        C("copyout-shape", lambda e: e.big.copyout(np.zeros((2, N), f32)), ic, r"shape must be"),
        C("copyin-zero-size", lambda e: e.raw.copyin(b""), ic, "must be 64 bytes"),
        C("load-directory", lambda e: e.raw.load(e.path.parent), ic, r"regular file \(got a dir"),
        C("alloc-nan", lambda e: e.d0.alloc(float("nan")), ic, "'nbytes' must be an int"),  # type: ignore[arg-type]
        C("alloc-struct-object", lambda e: e.d0.alloc(16, dtype=[("o", object)]), ic, "'dtype'"),
        C("alloc-dtype-empty", lambda e: e.d0.alloc(16, dtype="V0"), ic, "'dtype'"),
        C(
            "alloc-shared-huge",
            lambda e: e.d0.alloc(1 << 62, shared=True),
            OutOfMemory,
            "out of",
            False,
        ),
        C("view-huge", lambda e: e.raw.view(0, 1 << 70), ic, "must lie within"),
        C("numpy-view-freed", lambda e: e.freed.numpy_view(), ic, "was freed", False),
        C("import-bad-fd", lambda e: e.d0.import_buffer(-1, 64), ic, r"open memfd \(got fd -1"),
        C("import-fd-str", lambda e: e.d0.import_buffer("3", 64), ic, "'fd' must be an int"),  # type: ignore[arg-type]
        C("import-zero", lambda e: e.d0.import_buffer(0, 0), ic, "'nbytes' must be >= 1"),
        C("program-async", lambda e: e.d0.program("p", _async_kernel), ic, "async def"),
        C("program-generator", lambda e: e.d0.program("p", _gen_kernel), ic, "generator"),
        # -- Queue verbs --------------------------------------------------------------------------
        C("wait-closed-signal", lambda e: e.q.wait(e.gone, 1), dc_, "'gone' is closed", False),
        C("signal-closed-signal", lambda e: e.q.signal(e.gone, 1), dc_, "is closed", False),
        C("timestamp-closed", lambda e: e.q.timestamp(e.gone), dc_, "is closed", False),
        C("wait-capture-fence", lambda e: _wait_on_capture_fence(e), ic, "await the replay", False),
        C("wait-not-signal", lambda e: e.q.wait(3, 1), ic, "'signal' must be a hcqa.Signal"),  # type: ignore[arg-type]
        C("wait-neg", lambda e: e.q.wait(e.s, -1), ic, r"'value' must be in \[0, 2\*\*64 - 1\]"),
        C("wait-huge", lambda e: e.q.wait(e.s, 2**64), ic, r"'value' must be in"),
        C("wait-float", lambda e: e.q.wait(e.s, 1.0), ic, "'value' must be an int"),  # type: ignore[arg-type]
        C("signal-str", lambda e: e.q.signal(e.s, "1"), ic, "'value' must be an int"),  # type: ignore[arg-type]
        C("timestamp-int", lambda e: e.q.timestamp(3), ic, "'signal'"),  # type: ignore[arg-type]
        C("exec-on-copy", lambda e: e.qc.exec(e.c, (e.b, e.a), vals=(N,)), ic, "compute queue"),
        C("exec-not-program", lambda e: e.q.exec(_two, (e.b, e.a)), ic, "Program"),  # type: ignore[arg-type]
        C("exec-other-device", lambda e: e.q.exec(e.c1, (e.b, e.a), vals=(N,)), ic, "cpu:0"),
        C("exec-bufs-buffer", lambda e: e.q.exec(e.py, e.b), ic, "'bufs' must be a tuple"),  # type: ignore[arg-type]
        C("exec-bad-vals", lambda e: e.q.exec(e.c, (e.b, e.a), vals=(2**40,)), ic, "must be in"),
        C("copy-on-compute", lambda e: e.q.copy(e.b, e.a, 8), ic, "copy queue"),
        C("copy-other-device", lambda e: e.qc.copy(e.other, e.a, 8), ic, "transfer"),
        C("copy-zero", lambda e: e.qc.copy(e.b, e.a, 0), ic, r"'nbytes' must be in \[1, 64\]"),
        C("copy-too-long", lambda e: e.qc.copy(e.b, e.big, 65), ic, r"must be in \[1, 64\]"),
        C("copy-array", lambda e: e.qc.copy(np.zeros(N, f32), e.a, 8), ic, "'dest'"),  # type: ignore[arg-type]
        C("copy-nbytes-str", lambda e: e.qc.copy(e.b, e.a, "8"), ic, "'nbytes'"),  # type: ignore[arg-type]
        # -- submitting queues with variables ------------------------------------------------------
        C("submit-unbound", lambda e: e.qv.submit(), ic, "unbound", False),
        C("submit-missing", lambda e: e.qv.submit(var_vals={}), ic, "'n' is unbound", False),
        C("submit-unknown", lambda e: e.qv.submit(var_vals={"m": 1}), ic, r"unknown variables"),
        C("submit-range-hi", lambda e: e.qv.submit(var_vals={e.n: N + 1}), ic, r"\[1, 16\]"),
        C("submit-range-lo", lambda e: e.qv.submit(var_vals={"n": 0}), ic, r"\[1, 16\]"),
        C("submit-str", lambda e: e.qv.submit(var_vals={"n": "3"}), ic, "bound to an int"),  # type: ignore[dict-item]
        C("submit-async-range", lambda e: e.qv.submit_async(var_vals={"n": 99}), ic, r"\[1, 16\]"),
        C(
            "submit-div-zero",
            lambda e: _div_queue(e).submit(var_vals={"n": 1}),
            ic,
            "divides",
            False,
        ),
        C(
            "submit-neg-signal",
            lambda e: e.d0.compute_queue().signal(e.s, e.n - 5).submit(var_vals={"n": 1}),
            ic,
            r"'value' must be in",
        ),
        C(
            "submit-global-zero",
            lambda e: (
                e.d0.compute_queue()
                .exec(e.py, (e.b, e.a), global_size=(e.n - 1,))
                .submit(var_vals={"n": 1})
            ),
            ic,
            "'global_size' must be positive",
        ),
        C(
            "submit-copy-size",
            lambda e: e.d0.copy_queue().copy(e.b, e.a, e.n * 8).submit(var_vals={"n": 9}),
            ic,
            r"'nbytes' must be in \[1, 64\]",
        ),
        # -- signals and variables -----------------------------------------------------------
        C("signal-neg", lambda e: Signal(-1), ic, r"must be in \[0, 2\*\*64 - 1\]"),
        C("signal-huge", lambda e: Signal(2**64), ic, r"must be in \[0"),
        C("signal-float", lambda e: Signal(1.5), ic, "must be an int"),  # type: ignore[arg-type]
        C("signal-set-neg", lambda e: setattr(e.s, "value", -1), ic, r"must be in \[0"),
        C("signal-set-none", lambda e: setattr(e.s, "value", None), ic, "must be an int"),
        C("signal-wait-neg", lambda e: e.s.wait(-1), ic, r"must be in \[0"),
        C("signal-wait-str", lambda e: e.s.wait("1"), ic, "must be an int"),  # type: ignore[arg-type]
        C(
            "fence-wait-sync-timeout",
            lambda e: e.d0.timeline.wait_sync(0, timeout=-0.5),
            ic,
            r"'timeout' must be >= 0",
        ),
        C(
            "fence-wait-sync-value",
            lambda e: hcqa.Fence(e.s, -1).wait_sync(timeout=0),
            ic,
            r"must be in \[",
        ),
        C("signal-wait-sync-timeout", lambda e: e.s.wait_sync(0, timeout=-1), ic, "'timeout'"),
        C("wait-sync-nan", lambda e: e.s.wait_sync(1, timeout=float("nan")), ic, "'timeout'"),
        C("wait-sync-str", lambda e: e.s.wait_sync(1, timeout="1"), ic, "'timeout'"),  # type: ignore[arg-type]
        C("add-peer-neg", lambda e: e.s.add_peer(-1), ic, r"open fd >= 0 \(got -1\)"),
        C("add-peer-str", lambda e: e.s.add_peer("x"), ic, r"int fd \(got str\)"),  # type: ignore[arg-type]
        C("add-peer-closed-signal", lambda e: e.gone.add_peer(-1), ic, "open fd"),
        C("signal-name-empty", lambda e: Variable("", 0, 1), ic, "non-empty str"),
        C("attach-index", lambda e: Signal.attach(e.s.export()[0], -1), ic, r"'index' must be in"),
        C("attach-index-str", lambda e: Signal.attach(e.s.export()[0], "0"), ic, "'index'"),  # type: ignore[arg-type]
        C("attach-fd-neg", lambda e: Signal.attach(-1, 0), ic, r"'page_fd' must be an open memfd"),
        C("attach-fd-str", lambda e: Signal.attach("x", 0), ic, r"'page_fd' must be an int fd"),  # type: ignore[arg-type]
        C("alloc-shared-str", lambda e: e.d0.alloc(8, shared="yes"), ic, "'shared' must be a bool"),  # type: ignore[arg-type]
        C(
            "program-entry-int",
            lambda e: e.d0.program("p", ADD1, entry=3),
            ic,
            "'entry' must be a non-empty str",
        ),  # type: ignore[arg-type]
        C("tracer-max-events", lambda e: hcqa.Tracer(e.path, max_events=-1), ic, "'max_events'"),
        C("export-not-shared", lambda e: e.raw.export(), ic, "alloc\\(..., shared=True\\)"),
        C("write-timestamp-neg", lambda e: e.s.write_timestamp(-1), ic, r"'ns' must be in \["),
        C("write-timestamp-str", lambda e: e.s.write_timestamp("1"), ic, "'ns' must be an int"),  # type: ignore[arg-type]
        C("write-timestamp-closed", lambda e: e.gone.write_timestamp(1), dc_, "closed", False),
        C("signal-set-closed", lambda e: setattr(e.gone, "value", 1), dc_, "closed", False),
        C("replay-buffers-str", lambda e: e.g.submit(buffers="x", n=1), ic, "'buffers'"),  # type: ignore[arg-type]
        C("replay-buffers-foreign", lambda e: e.g.submit(buffers={e.b: e.other}, n=1), ic, "cpu"),
        C(
            "tracer-save-dir",
            lambda e: hcqa.Tracer(e.path).save(e.path.parent),
            OSError,
            "can't write",
            False,
        ),
        C("tracer-dir", lambda e: hcqa.Tracer(e.path.parent), ic, "must be a file"),
        C("tracer-missing-dir", lambda e: hcqa.Tracer(e.path / "x" / "t.json"), ic, "can't write"),
        C("variable-range", lambda e: Variable("v", 5, 1), ic, r"'hi' must be >= lo = 5 \(got 1\)"),
        C("variable-lo-float", lambda e: Variable("v", 0.5, 1), ic, "'lo' must be an int"),  # type: ignore[arg-type]
        C("variable-name-int", lambda e: Variable(3, 0, 1), ic, "'name'"),  # type: ignore[arg-type]
        C("variable-plus-float", lambda e: e.n + 1.5, py_te, "unsupported operand", False),  # type: ignore[operator]
        # -- graphs ------------------------------------------------------------------------------
        C("replay-unknown", lambda e: e.g.submit(n=1, m=2), ic, r"unknown variables \['m'\]"),
        C("replay-missing", lambda e: e.g.submit(), ic, "'n' is unbound", False),
        C("replay-range", lambda e: e.g.submit(n=N + 1), ic, r"\[1, 16\]"),
        C("replay-type", lambda e: e.g.submit(n="1"), ic, "bound to an int"),  # type: ignore[arg-type]
        C("replay-async-range", lambda e: e.g(n=0), ic, r"\[1, 16\]"),
        C("replay-empty", lambda e: e.empty.submit(), ic, "captured no work", False),
        C(
            "replay-in-capture",
            lambda e: _in_capture(lambda: e.g.submit(n=1)),
            ic,
            "inside a capture",
            False,
        ),
        C(
            "capture-nested",
            lambda e: _in_capture(lambda: _in_capture(lambda: None)),
            ic,
            "can't be nested",
            False,
        ),
        C(
            "capture-bad-call",
            lambda e: _in_capture(lambda: e.c(e.b, e.a, vals=(N + 2**31,))),
            ic,
            r"must be in \[",
        ),
        C("capture-fence-await", lambda e: _await_capture_fence(e), ic, "await the replay", False),
        # -- a closed device -------------------------------------------------------------------
        C("closed-alloc", lambda e: e.dc.alloc(8), dc_, "cpu:2 is closed", False),
        C("closed-program", lambda e: e.dc.program("p", _two), dc_, "cpu:2 is closed", False),
        C("closed-call", lambda e: e.cprog(e.ca, e.ca, vals=(N,)), dc_, "closed", False),
        C("closed-timed", lambda e: e.cprog.timed(e.ca, e.ca, vals=(N,)), dc_, "closed", False),
        C("closed-copyin", lambda e: e.ca.copyin(np.zeros(N, f32)), dc_, "closed", False),
        C("closed-copyout", lambda e: e.ca.copyout(np.zeros(N, f32)), dc_, "closed", False),
        C("closed-load", lambda e: e.ca.load(e.path), dc_, "closed", False),
        C("closed-transfer-to", lambda e: hcqa.transfer(e.ca, e.a), dc_, "closed", False),
        C("closed-transfer-from", lambda e: hcqa.transfer(e.a, e.ca), dc_, "closed", False),
        C("closed-queue-verb", lambda e: e.dc.compute_queue().signal(e.s, 1), dc_, "closed", False),
        C("closed-queue-submit", lambda e: e.cq.submit(), dc_, "closed", False),
        C("closed-replay", lambda e: e.cg.submit(n=1), dc_, "closed", False),
        C(
            "closed-capture",
            lambda e: _in_capture(lambda: e.cprog(e.ca, e.ca, vals=(N,))),
            dc_,
            "closed",
            False,
        ),
        C("closed-testing-helper", lambda e: ht.failing_kernel(e.dc), dc_, "closed", False),
    ]
    out = []
    for case in cases:
        marks = _KNOWN.get(case.id)
        out.append(pytest.param(case, id=case.id, marks=marks) if marks else case)
    return out


async def _async_kernel(out: Any) -> None:  # pragma: no cover - never accepted
    pass


def _gen_kernel(out: Any) -> Any:  # pragma: no cover - never accepted
    yield


def _wait_on_capture_fence(e: Env) -> None:
    with hcqa.capture():
        fence = e.py(e.b, e.a)
    e.q.wait(fence.signal, fence.value)


def _readonly(n: int) -> npt.NDArray[np.float32]:
    arr = np.zeros(n, np.float32)
    arr.flags.writeable = False
    return arr


def _div_queue(e: Env) -> hcqa.Queue:
    q: hcqa.Queue = e.d0.compute_queue()
    return q.signal(e.s, 10 // (e.n - 1))


def _in_capture(fn: Callable[[], Any]) -> Any:
    with hcqa.capture():
        return fn()


async def _await_capture_fence(e: Env) -> None:
    with hcqa.capture():
        fence = e.py(e.b, e.a)
    await fence


# Cases whose outcome is a known bug (see the report / docs/reliability.md).
_KNOWN: dict[str, Any] = {}


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
async def test_bad_input_is_refused_and_changes_nothing(case: Case, tmp_path: Path) -> None:
    async with environment(tmp_path) as env:
        before, contents = _snapshot(env), _contents(env)
        with pytest.raises(case.error) as info:
            result = case.call(env)
            if inspect.isawaitable(result):
                await result
        msg = str(info.value)
        assert re.search(case.match, msg), msg
        if case.shows_seen:
            assert re.search(r"\bgot\b", msg), f"the message does not say what it got: {msg}"
        assert _snapshot(env) == before
        assert _contents(env) == contents
        assert env.d0.faulted is None and env.d1.faulted is None
        await _still_computes(env)


async def _still_computes(env: Env) -> None:
    """After the refusal both devices compute correctly: a C kernel, a copy out and a
    cross-device transfer, checked against numpy."""
    env.hold.value = 1  # let the held work go first: d0's compute queue waits behind it
    with trio.fail_after(SAFE):
        await env.c(env.b, env.a, vals=(N,))
        await hcqa.transfer(env.other, env.b)
        a, b, other = (np.empty(N, np.float32) for _ in range(3))
        await env.a.copyout(a)
        await env.b.copyout(b)
        await env.other.copyout(other)
    assert (b == a + 1).all() and (other == b).all()
    assert env.d0.faulted is None and env.d1.faulted is None


def test_the_matrix_covers_every_public_entry_point() -> None:
    """A new public name needs bad-input cases here (or a reason it takes no input)."""
    covered = {
        "Buffer",
        "CpuDevice",
        "Device",
        "Fence",
        "Graph",
        "Program",
        "Queue",
        "Signal",
        "Variable",
        "capture",
        "open_device",
        "open_devices",
        "transfer",
    }
    # their own test files check their arguments
    elsewhere = {"Pipeline", "Stage", "Tracer", "ProcessPipeline", "ProcessStage"}
    elsewhere |= {"open_process_pipeline", "Batcher", "open_batcher", "open_asyncio_host"}
    elsewhere |= {"TimedSpan"}  # tests/test_timed_span.py (queue name, capture, closed)
    no_input = {n for n in hcqa.__all__ if n.endswith(("Statistics", "Error"))} | {
        "DeviceClosed",
        "DeviceFault",
        "InvalidCommand",
        "OutOfMemory",
        "QueueFull",
        "SignalTimeout",
    }
    assert set(hcqa.__all__) <= covered | elsewhere | no_input


# Every public method and property of the classes above: those with cases in the matrix,
# and those that take no input (or only what the matrix hands them). A new one must join
# one of the two sets -- with cases, if it takes arguments.
METHODS_WITH_CASES = {
    "Device": {"alloc", "import_buffer", "program", "program_async", "compute_queue", "copy_queue"},
    "Buffer": {"copyin", "copyout", "export", "free", "load", "numpy_view", "view"},
    "Program": {"timed", "__call__"},
    "Queue": {"copy", "exec", "signal", "submit", "submit_async", "timestamp", "wait"},
    "Signal": {"add_peer", "attach", "timestamp", "value", "wait", "wait_sync", "write_timestamp"},
    "Fence": {"wait_sync"},
    "Graph": {"submit", "__call__"},
    "Tracer": {"save", "__init__"},
}
METHODS_WITHOUT_INPUT = {
    "Device": {"closed", "faulted", "statistics", "synchronize", "timeline", "clock_offset_ns"},
    "Device+elsewhere": {"timed"},  # tests/test_timed_span.py
    "Tracer+elsewhere": {"region"},  # tests/test_trace_regions.py (a name that is not a str)
    # what calls use (check_buffers: tests/test_launch_limits.py, a misaligned view)
    "Program": {"access", "c_args", "check_buffers", "check_geometry", "check_vals", "validate"},
    "Queue": {"memory_barrier", "variables"},
    "Signal": {"address", "close", "export", "fd", "statistics", "timestamp_address"},
    "Fence": {"reached", "wait"},
    "Graph": {"dump", "statistics"},
    "Tracer": {
        "after_io_wait", "after_run", "after_task_step", "before_io_wait", "before_run",
        "before_task_step", "engine_run", "sent", "start", "stop", "task_exited", "task_scheduled",
        "task_spawned", "waited",
    },  # trio's Instrument hooks and the engines' tracing hooks
}  # fmt: skip


def test_the_matrix_covers_every_public_method() -> None:
    classes = {
        "Device": hcqa.Device,
        "Buffer": hcqa.Buffer,
        "Program": hcqa.Program,
        "Queue": hcqa.Queue,
        "Signal": hcqa.Signal,
        "Fence": hcqa.Fence,
        "Graph": hcqa.Graph,
        "Tracer": hcqa.Tracer,
    }
    for name, cls in classes.items():
        public = {
            n
            for n, v in inspect.getmembers(cls)
            if not n.startswith("_") and (callable(v) or isinstance(v, property))
        }
        known = METHODS_WITH_CASES.get(name, set()) | METHODS_WITHOUT_INPUT.get(name, set())
        known |= METHODS_WITHOUT_INPUT.get(f"{name}+elsewhere", set())
        assert public <= known, f"{name}: no bad-input cases for {sorted(public - known)}"


async def test_timed_inside_a_capture_is_refused_before_recording(tmp_path: Path) -> None:
    async with environment(tmp_path) as env:
        with hcqa.capture() as g:
            with pytest.raises(InvalidCommand, match="can't be captured"):
                await env.c.timed(env.b, env.a, vals=(N,))
        assert g.statistics().nodes == 0  # a recorded Timestamp would outlive its signals


async def test_small_input_fixes() -> None:
    """Unknown open options name the public function; numpy ints work as vals; a
    signal's name must be a str."""
    with pytest.raises(TypeError, match=r"open_devices\(\) got unknown options \['bogus'\]"):
        async with hcqa.open_device("cpu:0", bogus=1):
            pass  # pragma: no cover
    with pytest.raises(TypeError, match="'name' must be a str"):
        hcqa.Signal(name=3)  # type: ignore[arg-type]
    async with hcqa.open_device("cpu:0") as d:
        seen: list[int] = []
        prog = d.program("take", lambda out, n: seen.append(n))
        await prog(d.alloc(8), vals=(np.int64(5),))
        assert seen == [5] and type(seen[0]) is int
