"""A sweep that complements the hand-written matrix in test_bad_input.py: every argument
of the public entry points below gets every value of a list of wrong ones (negative, huge,
NaN, inf, fractional, strings, None, bools, bytes, objects, numpy scalars, containers).

For each call the outcome must be one of: accepted (and then it must work: a returned fence
is reached and nothing faults), or an hcqa error -- ``InvalidCommand`` (whose message says
what it got), ``OutOfMemory``, ``DeviceClosed`` or ``SignalTimeout``. Never another
exception, never a fault. After each entry point's sweep the device still computes right.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import hcqa
from hcqa import DeviceClosed, InvalidCommand, OutOfMemory, Signal, SignalTimeout, Variable

N = 16
ADD1 = """
void add1(float *out, const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + 1.0f;
}
"""

BAD: list[Any] = [
    -1,
    -(2**70),
    2**70,
    math.nan,
    math.inf,
    -math.inf,
    1.5,
    "1",
    "",
    None,
    True,
    b"x",
    object(),
    np.int64(-1),
    np.float32(1.0),
    [1],
    (),
    {},
]


def _copy(out: Any, a: Any) -> None:
    out[:] = a


class Env:
    def __init__(self, d: hcqa.Device, tmp: Path) -> None:
        self.d = d
        self.a = d.alloc(shape=(N,), dtype="float32")
        self.b = d.alloc(shape=(N,), dtype="float32")
        self.raw = d.alloc(64)
        self.py = d.program("copy", _copy)
        self.c = d.program("add1", ADD1)
        self.s = Signal(name="s")
        self.path = tmp / "data.bin"
        self.path.write_bytes(bytes(64))
        self.tmp = tmp
        self.n = Variable("n", 1, N)
        with hcqa.capture() as g:
            self.c(self.b, self.a, vals=(self.n,))
        self.g = g
        self.page_fd = self.s.export()[0]


# Each target: (id, call(env, value)). Device options and opening go through _enter.
async def _enter(**options: Any) -> None:
    async with hcqa.open_device("cpu:9", **options):
        pass


TARGETS: list[tuple[str, Callable[[Env, Any], Any]]] = [
    ("alloc-nbytes", lambda e, v: e.d.alloc(v)),
    ("alloc-shape", lambda e, v: e.d.alloc(shape=(v,), dtype="float32")),
    ("alloc-shape-whole", lambda e, v: e.d.alloc(shape=v, dtype="float32")),
    ("alloc-dtype", lambda e, v: e.d.alloc(8, dtype=v)),
    ("alloc-shared", lambda e, v: e.d.alloc(8, shared=v)),
    ("view-offset", lambda e, v: e.raw.view(v, 8)),
    ("view-nbytes", lambda e, v: e.raw.view(0, v)),
    ("view-dtype", lambda e, v: e.raw.view(0, 8, dtype=v)),
    ("load-path", lambda e, v: e.raw.load(v)),
    ("load-offset", lambda e, v: e.raw.load(e.path, offset=v)),
    ("load-nbytes", lambda e, v: e.raw.load(e.path, nbytes=v)),
    ("copyin", lambda e, v: e.raw.copyin(v)),
    ("copyout", lambda e, v: e.raw.copyout(v)),
    ("copyin-array-of", lambda e, v: e.raw.copyin(np.array([v] * 4))),
    ("program-src", lambda e, v: e.d.program("p", v)),
    ("program-name", lambda e, v: e.d.program(v, _copy)),
    ("program-writes", lambda e, v: e.d.program("p", _copy, writes=v)),
    ("program-entry", lambda e, v: e.d.program("add1", ADD1, entry=v)),
    ("call-buffer", lambda e, v: e.py(e.b, v)),
    ("call-val", lambda e, v: e.c(e.b, e.a, vals=(v,))),
    ("call-vals", lambda e, v: e.c(e.b, e.a, vals=v)),
    ("call-global", lambda e, v: e.py(e.b, e.a, global_size=v)),
    ("call-local-dim", lambda e, v: e.py(e.b, e.a, local_size=(v, 1, 1))),
    ("timed-val", lambda e, v: e.c.timed(e.b, e.a, vals=(v,))),
    ("transfer-dest", lambda e, v: hcqa.transfer(v, e.a)),
    ("queue-wait-value", lambda e, v: e.d.compute_queue().wait(e.s, v)),
    ("queue-wait-signal", lambda e, v: e.d.compute_queue().wait(v, 1)),
    ("queue-signal-value", lambda e, v: e.d.compute_queue().signal(e.s, v).submit()),
    ("queue-timestamp", lambda e, v: e.d.compute_queue().timestamp(v)),
    ("queue-copy-nbytes", lambda e, v: e.d.copy_queue().copy(e.b, e.a, v).submit()),
    ("queue-exec-bufs", lambda e, v: e.d.compute_queue().exec(e.py, v)),
    ("queue-exec-prog", lambda e, v: e.d.compute_queue().exec(v, (e.b, e.a))),
    ("queue-submit-var", lambda e, v: e.d.compute_queue().signal(e.s, e.n).submit({"n": v})),
    ("replay-var", lambda e, v: e.g.submit(n=v)),
    ("replay-buffers", lambda e, v: e.g.submit(buffers=v, n=1)),
    ("signal-initial", lambda e, v: Signal(v).close()),
    ("signal-name", lambda e, v: Signal(name=v).close()),
    ("signal-set", lambda e, v: setattr(e.s, "value", v)),
    ("signal-wait", lambda e, v: e.s.wait(v)),
    ("signal-wait-sync", lambda e, v: e.s.wait_sync(v, timeout=0)),
    ("signal-wait-sync-timeout", lambda e, v: e.s.wait_sync(0, timeout=v)),
    ("signal-add-peer", lambda e, v: e.s.add_peer(v)),
    ("signal-write-timestamp", lambda e, v: e.s.write_timestamp(v)),
    ("signal-attach-fd", lambda e, v: Signal.attach(v, 0)),
    ("signal-attach-index", lambda e, v: Signal.attach(os.dup(e.page_fd), v)),
    ("fence-wait-sync-timeout", lambda e, v: hcqa.Fence(e.s, 0).wait_sync(v)),
    ("variable-name", lambda e, v: Variable(v, 0, 1)),
    ("variable-lo", lambda e, v: Variable("x", v, 10)),
    ("variable-hi", lambda e, v: Variable("x", 0, v)),
    ("import-fd", lambda e, v: e.d.import_buffer(v, 64)),
    ("import-nbytes", lambda e, v: e.d.import_buffer(os.dup(e.page_fd), v)),
    ("tracer-path", lambda e, v: hcqa.Tracer(v)),
    ("tracer-max-events", lambda e, v: hcqa.Tracer(e.tmp / "t.json", max_events=v)),
    ("open-spec", lambda e, v: _enter_spec(v)),
    ("open-hang-limit", lambda e, v: _enter(hang_limit=v)),
    ("open-host-visible", lambda e, v: _enter(host_visible=v)),
    ("open-queue-depth", lambda e, v: _enter(queue_depth=v)),
    ("open-memory", lambda e, v: _enter(memory=v)),
    ("open-timeline-start", lambda e, v: _enter(timeline_start=v)),
]


async def _enter_spec(spec: Any) -> None:
    async with hcqa.open_device(spec):
        pass


OK_ERRORS = (InvalidCommand, OutOfMemory, DeviceClosed, SignalTimeout)


async def _outcome(env: Env, call: Callable[[Env, Any], Any], value: Any) -> str:
    try:
        with trio.fail_after(10):
            result = call(env, value)
            if inspect.isawaitable(result):
                result = await result
            if isinstance(result, hcqa.Fence):
                await result
            if isinstance(result, Signal):
                result.close()
            if isinstance(result, hcqa.Buffer) and result.base is None:
                result.free()
        return "accepted"
    except OK_ERRORS as exc:
        if isinstance(exc, InvalidCommand) and "got" not in str(exc):
            return f"PROBLEM: the message does not say what it got: {exc}"
        return type(exc).__name__
    except Exception as exc:
        return f"PROBLEM: {type(exc).__name__}: {exc}"


async def _still_computes(env: Env) -> None:
    with trio.fail_after(10):
        src = np.arange(N, dtype=np.float32)
        await env.a.copyin(src)
        await env.c(env.b, env.a, vals=(N,))
        out = np.empty(N, np.float32)
        await env.b.copyout(out)
    assert (out == src + 1).all()
    assert env.d.faulted is None


@pytest.mark.parametrize(("name", "call"), TARGETS, ids=[t[0] for t in TARGETS])
async def test_every_wrong_value_is_refused_or_works(
    name: str, call: Callable[[Env, Any], Any], tmp_path: Path
) -> None:
    async with hcqa.open_device("cpu:0", hang_limit=30.0, memory=1 << 30) as d:
        env = Env(d, tmp_path)
        outcomes = {}
        for value in BAD:
            outcomes[repr(value)] = await _outcome(env, call, value)
            assert d.faulted is None, f"{name}({value!r}) faulted the device: {d.faulted}"
        problems = {v: o for v, o in outcomes.items() if o.startswith("PROBLEM")}
        assert not problems, problems
        await _still_computes(env)
        # the sweep meant something: most of these values are refused
        assert list(outcomes.values()).count("accepted") <= len(BAD) // 2, outcomes
        env.s.close()
