"""Graphs for real workloads (issue 17): replay on other buffers, incremental patching."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio

import hcqa
import hcqa._graph.patch
import hcqa.variables
from hcqa import InvalidCommand, Tracer, Variable
from hcqa._graph.patch import CommandSlot
from hcqa.devices.cpu.crunner import RunC

ADDK = """
void addk(long *out, const long *a, long k, long n) {
    for (long i = 0; i < n; i++) out[i] = a[i] + k;
}
"""

ADDK_I8 = """
void addk(long *out, const long *a, signed char k, long n) {
    for (long i = 0; i < n; i++) out[i] = a[i] + k;
}
"""

ADD32 = """
void add32(long *out, const long *a, int k) { for (int i = 0; i < 4; i++) out[i] = a[i] + k; }
"""

TIMEOUT = 20.0
I64 = np.int64


async def _read(buf: hcqa.Buffer) -> npt.NDArray[Any]:
    out = np.empty(buf.shape or (), dtype=buf.dtype)
    await buf.copyout(out)
    return out


def _i64(d: hcqa.Device, n: int = 4) -> hcqa.Buffer:
    return d.alloc(shape=(n,), dtype="int64")


def _sent(*devs: hcqa.Device) -> list[tuple[int, int, int]]:
    return [(d.statistics().timeline_reserved, d.compute.sent, d.copy.sent) for d in devs]


# -- rebinding -----------------------------------------------------------------------------


async def test_rebinding_runs_the_graph_on_other_buffers_fused_and_not() -> None:
    def slow_add(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
        out[:] = a + 100

    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK)
            py = d.program("slow_add", slow_add)
            x, t, out = _i64(d), _i64(d), _i64(d)
            x2, out2 = _i64(d), _i64(d)
            await x.copyin(np.arange(4, dtype=I64))
            await x2.copyin(np.arange(10, 14, dtype=I64))
            with hcqa.capture() as g:
                addk(t, x, vals=(1, 4))  # fused run of two C kernels ...
                addk(t, t, vals=(2, 4))
                py(out, t)  # ... then a Python kernel
            assert g.statistics().native_runs == 1
            await g(buffers={x: x2, out: out2})
            assert (await _read(out2)).tolist() == [113, 114, 115, 116]
            assert (await _read(out)).tolist() == [0, 0, 0, 0]  # untouched
            fence = g.submit()  # no rebinding: the captured buffers again
            await fence
            assert (await _read(out)).tolist() == [103, 104, 105, 106]
            fence = g.submit(buffers={out: out2, x: x})  # identity entries are allowed
            assert isinstance(fence, hcqa.Fence)
            await fence
            assert (await _read(out2)).tolist() == [103, 104, 105, 106]
            assert g.statistics().native_runs == 1  # nothing rebuilt for good


async def test_a_rebound_fused_run_names_the_buffers_it_runs_on() -> None:
    """A fused C run rebound for a replay reads and writes the new buffers at every place the
    old ones held -- a buffer read twice, one both read and written -- and nothing else moves;
    the template stays on its own buffers, so replays rebound alternately and not at all each
    compute on theirs and carry their hazards."""
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK)
            a, b, c, a2, c2 = (_i64(d) for _ in range(5))
            with hcqa.capture() as g:
                addk(b, a, vals=(1, 4))  # b = a + 1
                addk(a, b, vals=(2, 4))  # a = b + 2 (a read, then written)
                addk(c, a, vals=(3, 4))  # c = a + 3 (a read again)
            assert g.statistics().native_runs == 1
            (run,) = [x for x in g._plan.parts[0].template if isinstance(x, RunC)]
            for rebind in ({a: a2}, {c: c2}, {a: a2, c: c2}, {b: b}, {a2: c2}):
                got = run.bound(None, rebind)
                assert got.reads == tuple(rebind.get(x, x) for x in run.reads), rebind
                assert got.writes == tuple(rebind.get(x, x) for x in run.writes), rebind
            assert a in run.reads and a in run.writes and a2 not in run.reads  # untouched
            await a.copyin(np.zeros(4, I64))
            await a2.copyin(np.full(4, 100, I64))
            g.submit(buffers={a: a2, c: c2})  # no await: the copy-outs wait by hazards
            host = np.empty(4, I64)
            await c2.copyout(host)
            assert host.tolist() == [106] * 4 and (await _read(a2)).tolist() == [103] * 4
            await g()
            assert (await _read(c)).tolist() == [6] * 4 and (await _read(a)).tolist() == [3] * 4
            await g(buffers={a: a2})  # a2 = 103 -> 106, c = 109
            assert (await _read(c)).tolist() == [109] * 4
            assert (await _read(a2)).tolist() == [106] * 4
            assert (await _read(a)).tolist() == [3] * 4


async def test_rebinding_a_transfer_and_host_copies() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            x, y = _i64(d0), _i64(d1)
            x2, y2 = _i64(d0), _i64(d1)
            host = np.zeros(4, I64)
            with hcqa.capture() as g:
                hcqa.transfer(y, x)
                y.copyout(host)
            await x2.copyin(np.full(4, 7, I64))
            await g(buffers={x: x2})
            assert host.tolist() == [7] * 4
            await g(buffers={x: x2, y: y2})
            assert (await _read(y2)).tolist() == [7] * 4
            assert host.tolist() == [7] * 4


async def test_rebound_buffers_carry_the_replays_hazards() -> None:
    # a slow kernel reads x2 and writes out2; eager work queued right after the replay on
    # other queues must wait for it: the copyout sees the result, the copyin into x2 does
    # not overtake the kernel's read
    def slow_copy(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
        time.sleep(0.1)  # the kernel at work (a thread asleep), not synchronisation
        out[:] = a

    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("slow_copy", slow_copy)
            x, out, x2, out2 = _i64(d), _i64(d), _i64(d), _i64(d)
            with hcqa.capture() as g:
                prog(out, x)
            await x2.copyin(np.full(4, 5, I64))
            g.submit(buffers={x: x2, out: out2})
            overwrite = x2.copyin(np.full(4, 9, I64))  # a write after the replay's read
            host = np.zeros(4, I64)
            await out2.copyout(host)  # a read after the replay's write
            await overwrite
            assert host.tolist() == [5] * 4
            assert (await _read(x2)).tolist() == [9] * 4


async def test_rebinding_with_variables_leaves_the_cached_commands_alone() -> None:
    seen: list[tuple[int, int]] = []

    def k(out: npt.NDArray[Any], a: npt.NDArray[Any], n: int) -> None:
        out[:] = a + n
        seen.append((int(a[0]), n))

    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("k", k)
            addk = d.program("addk", ADDK)
            n = Variable("n", 0, 100)
            x, out, x2, out2 = _i64(d), _i64(d), _i64(d), _i64(d)
            await x2.copyin(np.full(4, 50, I64))
            with hcqa.capture() as g:
                prog(out, x, vals=(n,))
                addk(out, out, vals=(n, 4))  # a symbolic C kernel: a slot of its own
            await g(n=1)
            await g(n=1, buffers={x: x2, out: out2})
            await g(n=1)
            assert seen == [(0, 1), (50, 1), (0, 1)]
            assert (await _read(out)).tolist() == [2] * 4
            assert (await _read(out2)).tolist() == [52] * 4


async def test_bad_rebindings_are_refused_before_anything_is_sent() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_devices("cpu:0", "cpu:1") as (d0, d1):
            addk = d0.program("addk", ADDK)
            x, out, other = _i64(d0), _i64(d0), _i64(d0)
            base = _i64(d0, 8)
            view = base.view(0, 32, dtype="int64", shape=(4,))
            with hcqa.capture() as g:
                addk(out, x, vals=(1, 4))
            with hcqa.capture() as gv:
                addk(view, base, vals=(1, 4))  # base and its view: one allocation
            before = _sent(d0, d1)
            cases: list[tuple[Any, type[Exception], str]] = [
                ({x: _i64(d1)}, InvalidCommand, "must have device cpu:0 (got cpu:1)"),
                ({x: _i64(d0, 5)}, InvalidCommand, "must have nbytes 32 (got 40)"),
                (
                    {x: d0.alloc(shape=(4,), dtype="float64")},
                    InvalidCommand,
                    "must have dtype int64 (got float64)",
                ),
                (
                    {x: d0.alloc(shape=(2, 2), dtype="int64")},
                    InvalidCommand,
                    "must have shape (4,) (got (2, 2))",
                ),
                ({x: d0.alloc(32)}, InvalidCommand, "must have dtype int64 (got None)"),
                ({other: _i64(d0)}, InvalidCommand, "must be a buffer this graph captured"),
                ({x: out}, InvalidCommand, "must not share memory"),
                ({x: other, out: other}, InvalidCommand, "must not share memory"),
                ({x: np.zeros(4)}, TypeError, "must be hcqa.Buffers"),
                ([(x, other)], TypeError, "'buffers' must be a dict"),
            ]
            for mapping, exc, match in cases:
                with pytest.raises(exc, match=re.escape(match)):
                    g.submit(buffers=mapping)
                with pytest.raises(exc, match=re.escape(match)):
                    await g(buffers=mapping)
            with pytest.raises(InvalidCommand, match="also uses its memory through another"):
                gv.submit(buffers={base: _i64(d0, 8)})
            freed = _i64(d0)
            freed.free()
            with pytest.raises(InvalidCommand, match="was freed"):
                g.submit(buffers={x: freed})
            assert _sent(d0, d1) == before
            # a swap is fine: both are the graph's own buffers, exchanged
            await x.copyin(np.full(4, 3, I64))
            await g(buffers={x: out, out: x})
            assert (await _read(x)).tolist() == [0 + 1] * 4


async def test_a_freed_captured_buffer_can_be_replaced() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK)
            x, out = _i64(d), _i64(d)
            with hcqa.capture() as g:
                addk(out, x, vals=(2, 4))
            await g()
            x.free()
            with pytest.raises(InvalidCommand, match="was freed"):
                g.submit()
            x2 = _i64(d)
            await x2.copyin(np.full(4, 40, I64))
            await g(buffers={x: x2})
            assert (await _read(out)).tolist() == [42] * 4


# -- incremental patching ------------------------------------------------------------------


async def test_each_variable_resolved_once_and_unchanged_commands_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    binds = 0
    resolves = 0  # commands built (a Python kernel's vals are patched in place: none)
    real_bind, real_resolve = hcqa.variables._bind, hcqa._graph.patch._resolve_command

    def count_bind(var: Any, var_vals: Any) -> int:
        nonlocal binds
        binds += 1
        return real_bind(var, var_vals)

    def count_resolve(c: Any, *args: Any) -> Any:
        nonlocal resolves
        resolves += 1
        return real_resolve(c, *args)

    seen: list[int] = []

    def k(out: npt.NDArray[Any], n: int) -> None:
        seen.append(n)

    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK)
            py = d.program("k", k)
            n = Variable("n", 1, 4)
            a = _i64(d)
            with hcqa.capture() as g:
                for _ in range(50):
                    addk(a, a, vals=(1, n))  # one fused run, 50 entries of one variable
                py(a, vals=(n,))  # a Python kernel: a command slot
            assert g.statistics().native_runs == 1
            monkeypatch.setattr(hcqa.variables, "_bind", count_bind)
            monkeypatch.setattr(hcqa._graph.patch, "_resolve_command", count_resolve)
            await g(n=4)
            assert (binds, resolves) == (1, 0)  # the Python kernel: patched in place
            await g(n=4)
            assert (binds, resolves) == (2, 0)
            await g(n=2)
            assert (binds, resolves) == (3, 0)
    assert seen == [4, 4, 2]


async def test_symbolic_fused_runs_compute_per_replay_values() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK)
            n, k = Variable("n", 1, 4), Variable("k", -100, 100)
            a = _i64(d)
            with hcqa.capture() as g:
                for _ in range(10):
                    addk(a, a, vals=(k, n))
                addk(a, a, vals=(k * 2, 4))
            assert g.statistics().native_runs == 1
            await g(n=4, k=1)
            assert (await _read(a)).tolist() == [12] * 4
            await g(n=2, k=-1)
            assert (await _read(a)).tolist() == [0, 0, 10, 10]
            await g(n=2, k=-1)  # the same values again
            assert (await _read(a)).tolist() == [-12, -12, 8, 8]


async def test_symbolic_fused_run_range_checked_before_anything_is_sent() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            add32 = d.program("add32", ADD32)
            k = Variable("k", 0, 2**40)
            a = _i64(d)
            with hcqa.capture() as g:
                add32(a, a, vals=(k,))
                add32(a, a, vals=(k + 1,))
            assert g.statistics().native_runs == 1
            before = _sent(d)
            with pytest.raises(InvalidCommand, match=r"'add32' val 'k' must be in \[-2147483648"):
                g.submit(k=2**31)
            with pytest.raises(InvalidCommand, match="got 2147483648 from"):
                g.submit(k=2**31 - 1)  # k + 1 overflows the second kernel's int
            assert _sent(d) == before
            await g(k=5)
            assert (await _read(a)).tolist() == [11] * 4


async def test_static_commands_stay_static_and_fused_next_to_a_symbolic_one() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK)
            a = _i64(d)
            s = hcqa.Signal()
            v = Variable("v", 0, 1000)
            with hcqa.capture() as g:
                q = d.compute_queue()
                for _ in range(5):
                    q.exec(addk, (a, a), vals=(1, 4))
                q.signal(s, v).submit()
            assert g.statistics().native_runs == 1
            template = g._plan.parts[0].template
            assert sum(c is None for c in template) == 2  # the symbolic signal + the final one
            await g(v=7)
            assert s.value == 7
            assert (await _read(a)).tolist() == [5] * 4
    s.close()


def _three_symbolic_one_static(
    d: hcqa.Device,
) -> tuple[hcqa.Queue, hcqa.Buffer, hcqa.Signal, Variable, Variable]:
    """A queue of three kernels with a Variable, one without, and a signal with another."""
    addk = d.program("addk", ADDK)
    a = _i64(d)
    s = hcqa.Signal()
    n, v = Variable("n", 1, 4), Variable("v", 0, 100)
    q = d.compute_queue()
    for _ in range(3):
        q.exec(addk, (a, a), vals=(1, n))
    q.exec(addk, (a, a), vals=(1, 4)).signal(s, v)
    return q, a, s, n, v


async def test_queue_resubmits_rebuild_only_what_changed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Traced, a queue sends a command per kernel: only the commands whose values changed
    are rebuilt. (Untraced it is fused: see the next test.)"""
    resolves: list[str] = []
    real = hcqa._graph.patch._resolve_command

    def count(c: Any, *args: Any) -> Any:
        resolves.append(type(c).__name__)
        return real(c, *args)

    with trio.fail_after(TIMEOUT), Tracer(tmp_path / "t.json"):
        async with hcqa.open_device("cpu:0") as d:
            q, a, s, n, v = _three_symbolic_one_static(d)
            monkeypatch.setattr(hcqa._graph.patch, "_resolve_command", count)
            await q.submit({n: 4, v: 1})
            assert resolves == ["Exec"] * 3 + ["Signal"]
            await q.submit({n: 4, v: 2})  # only the signal's value changed
            assert resolves == ["Exec"] * 3 + ["Signal"] * 2
            await q.submit({n: 2, v: 2})
            assert resolves == ["Exec"] * 3 + ["Signal"] * 2 + ["Exec"] * 3
            assert s.value == 2
            assert (await _read(a)).tolist() == [12, 12, 9, 9]
    s.close()


async def test_queue_with_variables_is_fused_and_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Untraced, a queue's run of C kernels is one native call over an argument table: a new
    value is a fresh copy of the table, made only when a value the run uses changed."""
    resolves: list[str] = []
    tables: list[int] = []
    real = hcqa._graph.patch._resolve_command
    real_table = RunC.with_table

    def count(c: Any, *args: Any) -> Any:
        resolves.append(type(c).__name__)
        return real(c, *args)

    def count_table(self: RunC, table: Any) -> RunC:
        tables.append(len(table))
        return real_table(self, table)

    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            q, a, s, n, v = _three_symbolic_one_static(d)
            monkeypatch.setattr(hcqa._graph.patch, "_resolve_command", count)
            monkeypatch.setattr(RunC, "with_table", count_table)
            sent = q._resolve({n: 4, v: 1})
            assert [type(c).__name__ for c in sent] == ["RunC", "Signal"]
            await q.submit({n: 4, v: 1})
            assert (resolves, tables) == (["Signal"], [4 * 4])
            await q.submit({n: 4, v: 2})  # only the signal's value changed
            assert (resolves, tables) == (["Signal"] * 2, [16])
            await q.submit({n: 2, v: 2})  # only n changed: a new table, the same signal
            assert (resolves, tables) == (["Signal"] * 2, [16, 16])
            assert s.value == 2
            assert (await _read(a)).tolist() == [12, 12, 9, 9]
            assert len(q) == 5  # what the user built is unchanged
    s.close()


async def test_a_constant_queue_is_fused_from_its_second_submit(tmp_path: Path) -> None:
    """Sent once, a queue without variables goes as built (each command keeps its native
    record); sent again it goes fused; a new verb starts over; traced, never fused."""
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK)
            a = _i64(d)
            q = d.compute_queue().exec(addk, (a, a), vals=(1, 4)).exec(addk, (a, a), vals=(2, 4))
            sent: list[list[str]] = []
            send = q._send

            def spy(commands: list[Any]) -> hcqa.Fence:
                sent.append([type(c).__name__ for c in commands])
                return send(commands)

            q._send = spy  # type: ignore[method-assign]
            for _ in range(3):
                await q.submit()
            assert sent == [["Exec", "Exec"], ["RunC"], ["RunC"]]
            q.exec(addk, (a, a), vals=(4, 2))
            for _ in range(2):
                await q.submit()
            with Tracer(tmp_path / "t.json"):
                await q.submit()
            assert sent[3:] == [["Exec"] * 3, ["RunC"], ["Exec"] * 3]
            assert (await _read(a)).tolist() == [3 * 3 + 3 * 7] * 2 + [3 * 3 + 3 * 3] * 2


async def test_fused_queue_submits_in_flight_keep_their_own_values() -> None:
    """Submits with different values queued back to back, none awaited: each runs with its
    own values (a new table per value, never one patched under a queued run)."""
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK)
            a = _i64(d)
            n = Variable("n", 0, 1000)
            q = d.compute_queue()
            q.exec(addk, (a, a), vals=(n, 4)).exec(addk, (a, a), vals=(n, 2))
            q.exec(addk, (a, a), vals=(1, 4)).exec(addk, (a, a), vals=(n, 1))
            ks = (1, 10, 100, 10, 1000)
            fences = [q.submit({n: k}) for k in ks]
            await fences[-1]
            assert all(f.reached for f in fences)
            total = sum(ks)
            expect = [3 * total + 5, 2 * total + 5, total + 5, total + 5]
            assert (await _read(a)).tolist() == expect


async def test_fused_queue_refuses_an_out_of_range_value_before_sending() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK_I8)
            a = _i64(d)
            n = Variable("n", 0, 1000)  # wider than the kernel's int8_t parameter
            q = d.compute_queue()
            q.exec(addk, (a, a), vals=(n, 4)).exec(addk, (a, a), vals=(n, 4))
            await q.submit({n: 100})
            sent = d.compute.statistics().submitted
            with pytest.raises(InvalidCommand, match=r"'addk' val 'k' must be in \[-128, 127\]"):
                q.submit({n: 300})
            assert d.compute.statistics().submitted == sent  # nothing was queued
            await q.submit({n: 27})
            assert (await _read(a)).tolist() == [254] * 4


def test_rebinding_and_variables_under_asyncio() -> None:
    import asyncio

    async def main() -> list[int]:
        async with hcqa.open_device("cpu:0") as d:
            addk = d.program("addk", ADDK)
            n = Variable("n", 0, 10)
            x, out, x2, out2 = _i64(d), _i64(d), _i64(d), _i64(d)
            await x2.copyin(np.full(4, 20, I64))
            with hcqa.capture() as g:
                addk(out, x, vals=(n, 4))
            await g(n=3, buffers={x: x2, out: out2})
            host = np.zeros(4, I64)
            await out2.copyout(host)
            return [int(v) for v in host]

    assert asyncio.run(main()) == [23] * 4


async def test_a_python_kernels_vals_are_patched_in_place_per_replay() -> None:
    seen: list[tuple[int, int]] = []
    gate = threading.Event()

    def k(out: npt.NDArray[Any], a: int, b: int) -> None:
        gate.wait(TIMEOUT)
        seen.append((a, b))

    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("k", k)
            n = Variable("n", 0, 100)
            out = d.alloc(8)
            with hcqa.capture() as g:
                prog(out, vals=(n, 7))
                prog(out, vals=(3, n * 2))
            slots = [s for part in g._plan.parts for _, s in part.slots]
            assert len(slots) == 2
            slot, slot2 = slots
            assert isinstance(slot, CommandSlot) and isinstance(slot2, CommandSlot)
            assert slot.patch == (0, -1) and slot2.patch == (-1, 0)
            first = g.submit(n=1)  # held in the kernel: still in flight
            second = g.submit(n=2)  # patched again meanwhile
            gate.set()
            await first
            await second
            assert seen == [(1, 7), (3, 2), (2, 7), (3, 4)]
            assert slot.command.vals == (n, 7)  # the template is never written


MIXED = """
#include <stdint.h>
#include <stdbool.h>
void mixed(int64_t *out, uint8_t a, int16_t b, uint64_t c, bool d, int32_t e) {
    out[0] = a; out[1] = b; out[2] = (int64_t)(c >> 1); out[3] = d; out[4] = e;
}
"""


async def test_fused_queue_passes_every_c_parameter_type() -> None:
    """The generic runner calls each kernel through its signature's trampoline: narrow,
    signed, unsigned, 64-bit and bool parameters all arrive as the per-command path passes
    them, run after run."""
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            mixed = d.program("mixed", MIXED)
            add = d.program("addk", ADDK)
            out, other = _i64(d, 5), _i64(d)
            a, b = Variable("a", 0, 255), Variable("b", -32768, 32767)
            q = d.compute_queue()
            q.exec(mixed, (out,), vals=(a, b, 2**64 - 2, 1, -(2**31)))
            q.exec(add, (other, other), vals=(a, 4))
            for va, vb in ((255, -32768), (0, 32767), (7, -1)):
                await q.submit({a: va, b: vb})
                assert (await _read(out)).tolist() == [va, vb, 2**63 - 1, 1, -(2**31)]
            assert (await _read(other)).tolist() == [255 + 0 + 7] * 4
            assert [type(c).__name__ for c in q._resolve({a: 1, b: 2})] == ["RunC"]
