"""Graphs: capture, dependencies, replay with variables, fan-out, faults, cancellation."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
from _kinds import opencl_missing, spec, specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hcqa
from hcqa import DeviceFault, InvalidCommand, Variable

ADDK = """
void addk(long *out, const long *a, long k, long n) {
    for (long i = 0; i < n; i++) out[i] = a[i] + k;
}
"""

ADDI = """
void addi(long *out, const long *a, int k) {
    for (int i = 0; i < 4; i++) out[i] = a[i] + k;
}
"""

I64 = np.int64
E = 4  # int64 elements per region in the random-DAG test
RB = E * 8  # bytes per region


async def _read(buf: hcqa.Buffer) -> npt.NDArray[Any]:
    assert buf.dtype is not None
    out = np.empty(buf.nbytes // buf.dtype.itemsize, dtype=buf.dtype)
    await buf.copyout(out)
    return out


def _i64(n: int, device: hcqa.Device) -> hcqa.Buffer:
    return device.alloc(shape=(n,), dtype="int64")


def _lin(out: npt.NDArray[Any], a: npt.NDArray[Any], b: npt.NDArray[Any], k: int) -> None:
    out[:] = a * k + b


def _rev(a: npt.NDArray[Any], out: npt.NDArray[Any]) -> None:
    out[:] = a[::-1] + 1


def _acc(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
    out[:] = out + a


# The kernels again in OpenCL C, for the same tests on opencl devices: one work-item each,
# over the fixed sizes the tests use (a Python kernel sees its arrays' sizes; these can't).
CL = {
    "lin": "__kernel void lin(__global long *out, __global const long *a, __global const long *b,"
    " int k) { for (int i = 0; i < 4; i++) out[i] = a[i] * k + b[i]; }",
    "rev": "__kernel void rev(__global const long *a, __global long *out) { long t[4];"
    " for (int i = 0; i < 4; i++) t[i] = a[3 - i] + 1;"
    " for (int i = 0; i < 4; i++) out[i] = t[i]; }",
    "addk": "__kernel void addk(__global long *out, __global const long *a, int k, int n)"
    " { for (int i = 0; i < n; i++) out[i] = a[i] + k; }",
    "addi": "__kernel void addi(__global long *out, __global const long *a, int k)"
    " { for (int i = 0; i < 4; i++) out[i] = a[i] + k; }",
    "acc": "__kernel void acc(__global long *out, __global const long *a)"
    " { for (int i = 0; i < 4; i++) out[i] = out[i] + a[i]; }",
    "scale": "__kernel void scale(__global long *out, __global const long *a, int k)"
    " { for (int i = 0; i < 8; i++) out[i] = a[i] * k; }",
    "inc": "__kernel void inc(__global long *acc) { for (int i = 0; i < 4; i++) acc[i] += 1; }",
    "slow_lin": "__kernel void slow_lin(__global long *out, __global const long *a, int k)"
    " { for (int i = 0; i < 4; i++) out[i] = a[i] * k; }",
    "cp": "__kernel void cp(__global long *out, __global const long *a)"
    " { for (int i = 0; i < 4; i++) out[i] = a[i]; }",
    "fill": "__kernel void fill(__global long *out, int k)"
    " { for (int i = 0; i < 4; i++) out[i] = k; }",
    "make_x": "__kernel void make_x(__global long *out, __global const long *a,"
    " __global const long *b, int k) { for (int i = 0; i < 4; i++) out[i] = a[i] * k + b[i]; }",
}


def _prog(d: hcqa.Device, name: str, fn: Any, **options: Any) -> hcqa.Program:
    """``fn`` (a Python callable or C source) on cpu; the same kernel in OpenCL C on opencl."""
    if d.kind == "cpu":
        return d.program(name, fn, **options)
    return d.program(name, CL[name], entry=name, **options)


def _snapshot(devs: Sequence[hcqa.Device]) -> list[tuple[Any, ...]]:
    """What a replay that sent nothing must leave unchanged."""
    out = []
    for d in devs:
        st_ = d.statistics()
        out.append(
            (
                st_.timeline_reserved,
                tuple(q.submitted for q in st_.queues),
                d.compute.sent,
                d.copy.sent,
            )
        )
    return out


# -- the key property: a captured random DAG replays exactly like eager mode ------------------

# Per device: P0 (4 x int64), P1 (4), S (8, used through two views) and X (4, scratch).
# Regions 0..3 are P0, P1, S[:4], S[4:]; the reference keeps them as one row of 20 values.
NREG = 4


@st.composite
def _dags(draw: st.DrawFn) -> tuple[int, list[tuple[Any, ...]], int]:
    ndev = draw(st.integers(2, 3))
    r = st.integers(0, NREG - 1)
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["py", "rev", "c", "copy", "xfer", "xfer_whole"]))
        dev = draw(st.integers(0, ndev - 1))
        if kind == "py":
            ops.append(("py", dev, draw(r), draw(r), draw(r), draw(st.integers(0, 2))))
        elif kind == "rev":
            ops.append(("rev", dev, draw(r), draw(r)))
        elif kind == "c":
            ops.append(("c", dev, draw(r), draw(r), draw(st.integers(-3, 5))))
        elif kind == "copy":
            ops.append(("copy", dev, draw(r), draw(r)))
        elif kind == "xfer":
            src = (dev + draw(st.integers(1, ndev - 1))) % ndev
            ops.append(("xfer", dev, draw(r), src, draw(r)))
        else:  # the whole of S, the base of the views that regions 2 and 3 are
            src = (dev + draw(st.integers(1, ndev - 1))) % ndev
            ops.append(("xfer_whole", dev, src))
    return ndev, ops, draw(st.integers(0, 2**16))


class _Set:
    """One set of buffers on every device, with views made fresh at every use. S holds regions 2
    and 3 at offsets 0 and ``stride``: RB apart on cpu; on opencl as far apart as a view passed to
    a kernel must start (the device's base address alignment, 128 bytes on PoCL)."""

    def __init__(self, devs: Sequence[hcqa.Device]) -> None:
        self.stride = max(RB, *(_view_align(d) for d in devs))
        n_s = (self.stride + RB) // 8
        self.bufs = [(_i64(E, d), _i64(E, d), _i64(n_s, d), _i64(E, d)) for d in devs]

    def region(self, dev: int, r: int) -> hcqa.Buffer:
        p0, p1, s, _ = self.bufs[dev]
        if r < 2:
            return (p0, p1)[r]
        return s.view((r - 2) * self.stride, RB, dtype="int64")

    def scratch(self, dev: int) -> hcqa.Buffer:
        return self.bufs[dev][3]

    def _s_host(self, row: npt.NDArray[Any]) -> npt.NDArray[Any]:
        s = np.zeros(self.stride // 8 + E, I64)
        s[:E], s[self.stride // 8 :] = row[8:12], row[12:16]
        return s

    async def fill(self, init: npt.NDArray[Any]) -> None:
        for dev, bufs in enumerate(self.bufs):
            row = init[dev]
            parts = (row[0:4], row[4:8], self._s_host(row), row[16:20])
            for b, part in zip(bufs, parts, strict=True):
                await b.copyin(np.ascontiguousarray(part))

    async def read(self) -> npt.NDArray[Any]:
        rows = []
        for bufs in self.bufs:
            p0, p1, s, x = [await _read(b) for b in bufs]
            rows.append(np.concatenate([p0, p1, s[:E], s[self.stride // 8 :], x]))
        return np.stack(rows)


def _view_align(d: hcqa.Device) -> int:
    """Where a view passed to a kernel may start on ``d``: any byte on cpu."""
    if d.kind == "cpu":
        return 1
    cl_device = getattr(d, "cl_device", None)
    return int(cl_device.mem_base_addr_align) // 8 if cl_device is not None else 128


def _issue(ops: list[tuple[Any, ...]], s: _Set, devs: Sequence[hcqa.Device], progs: Any) -> None:
    """Enqueue every op (no awaits in between)."""
    for op in ops:
        kind, dev = op[0], op[1]
        lin, rev, addk, _acc = progs[dev]
        if kind == "py":
            _, _, o, a, b, k = op
            lin(s.region(dev, o), s.region(dev, a), s.region(dev, b), vals=(k,))
        elif kind == "rev":
            _, _, a, o = op
            rev(s.region(dev, a), s.region(dev, o))
        elif kind == "c":
            _, _, o, a, k = op
            addk(s.region(dev, o), s.region(dev, a), vals=(k, E))
        elif kind == "copy":
            _, _, o, a = op
            devs[dev].copy_queue().copy(s.region(dev, o), s.region(dev, a), RB).submit()
        elif kind == "xfer_whole":
            _, _, src = op
            hcqa.transfer(s.bufs[dev][2], s.bufs[src][2])
        else:
            _, _, o, src, a = op
            dest = s.region(dev, o)
            hcqa.transfer(dest, s.region(src, a))


def _reference(ops: list[tuple[Any, ...]], ref: npt.NDArray[Any]) -> None:
    def reg(dev: int, r: int) -> npt.NDArray[Any]:
        return ref[dev, r * E : r * E + E]

    for op in ops:
        kind, dev = op[0], op[1]
        if kind == "py":
            _, _, o, a, b, k = op
            _lin(reg(dev, o), reg(dev, a), reg(dev, b), k)
        elif kind == "rev":
            _, _, a, o = op
            _rev(reg(dev, a), reg(dev, o))
        elif kind == "c":
            _, _, o, a, k = op
            reg(dev, o)[:] = reg(dev, a) + k
        elif kind == "copy":
            _, _, o, a = op
            reg(dev, o)[:] = reg(dev, a)
        elif kind == "xfer_whole":
            _, _, src = op
            ref[dev, 8:16] = ref[src, 8:16]
        else:
            _, _, o, src, a = op
            reg(dev, o)[:] = reg(src, a)


def _programs(d: hcqa.Device) -> tuple[hcqa.Program, ...]:
    return (
        _prog(d, "lin", _lin),
        _prog(d, "rev", _rev, writes=(1,), reads=(0,)),
        _prog(d, "addk", ADDK),
        _prog(d, "acc", _acc),
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag=_dags())
async def test_random_dag_replay_matches_eager_and_numpy(
    dag: tuple[int, list[tuple[Any, ...]], int],
) -> None:
    await _replay_matches_eager_and_numpy("cpu", dag)


# Fewer examples on opencl: each opens its devices and builds its kernels again (~1 s here).
@pytest.mark.skipif(opencl_missing() is not None, reason=str(opencl_missing()))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag=_dags())
async def test_random_dag_replay_matches_eager_and_numpy_on_opencl(
    dag: tuple[int, list[tuple[Any, ...]], int],
) -> None:
    await _replay_matches_eager_and_numpy("opencl", dag)


async def _replay_matches_eager_and_numpy(
    kind: str, dag: tuple[int, list[tuple[Any, ...]], int]
) -> None:
    ndev, ops, seed = dag
    init = np.random.default_rng(seed).integers(-9, 10, size=(ndev, 20)).astype(I64)
    async with hcqa.open_devices(*specs(kind, ndev), hang_limit=10) as devs:
        progs = [_programs(d) for d in devs]
        eager, graph = _Set(devs), _Set(devs)
        await eager.fill(init)
        await graph.fill(init)
        before = _snapshot(devs)
        with hcqa.capture() as g:
            _issue(ops, graph, devs, progs)
        assert _snapshot(devs) == before  # capturing ran nothing
        ref = init.copy()
        for round_ in range(2):
            _issue(ops, eager, devs, progs)
            if round_ == 0:
                fence = g.submit()
                assert isinstance(fence, hcqa.Fence)
                with trio.fail_after(10):
                    await fence
            else:
                with trio.fail_after(10):
                    await g()
            for d in devs:
                await d.synchronize()
            _reference(ops, ref)
            got_eager, got_graph = await eager.read(), await graph.read()
            np.testing.assert_array_equal(got_eager, ref)
            np.testing.assert_array_equal(got_graph, got_eager)
        assert g.statistics().replays == 2


# -- variables ------------------------------------------------------------------------------


async def test_variables_change_results_and_bad_bindings_send_nothing(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 2), hang_limit=10) as devs:
        d0, d1 = devs
        n = Variable("n", 1, 8)
        k = Variable("k", 0, 100)
        addk0 = _prog(d0, "addk", ADDK)
        addk1 = _prog(d1, "addk", ADDK)

        def scale(out: npt.NDArray[Any], a: npt.NDArray[Any], kk: int) -> None:
            out[:] = a * kk

        sc = _prog(d0, "scale", scale)
        a = _i64(8, d0)
        out = _i64(8, d0)
        out2 = _i64(8, d0)
        t1 = _i64(8, d1)
        o1 = _i64(8, d1)
        x = np.arange(8, dtype=I64) * 3
        await a.copyin(x)
        for b in (out, out2):
            await b.copyin(np.zeros(8, I64))
        await o1.copyin(np.zeros(8, I64))

        with hcqa.capture() as g:
            addk0(out, a, vals=(5, n))  # C kernel, n symbolic
            sc(out2, out, vals=(k,))  # Python kernel, scale symbolic
            hcqa.transfer(t1, out2)
            d1.compute_queue().exec(addk1, (o1, t1), vals=(k + 1, n)).submit()
        assert g.statistics().variables == ("k", "n")
        # OpenCL fuses the two launches on d0, variables and all (opencl/runs.py)
        assert g.statistics().native_runs == (1 if kind == "opencl" else 0)

        prev_out = np.zeros(8, I64)
        prev_o1 = np.zeros(8, I64)
        for nn, kk in ((3, 2), (8, 7), (1, 0), (5, 100)):
            await g(n=nn, k=kk)
            want_out = prev_out.copy()
            want_out[:nn] = x[:nn] + 5
            want_out2 = want_out * kk
            want_o1 = prev_o1.copy()
            want_o1[:nn] = want_out2[:nn] + kk + 1
            np.testing.assert_array_equal(await _read(out), want_out)
            np.testing.assert_array_equal(await _read(out2), want_out2)
            np.testing.assert_array_equal(await _read(t1), want_out2)
            np.testing.assert_array_equal(await _read(o1), want_o1)
            prev_out, prev_o1 = want_out, want_o1

        for d in devs:
            await d.synchronize()
        contents = [await _read(b) for b in (out, out2, t1, o1)]
        before = _snapshot(devs)
        replays = g.statistics().replays
        bad: list[dict[str, Any]] = [
            {"k": 2},  # n unbound
            {"n": 3},  # k unbound
            {},  # both unbound
            {"n": 0, "k": 2},  # below range
            {"n": 9, "k": 2},  # above range
            {"n": 3, "k": 101},
            {"n": 3, "k": 2, "m": 1},  # unknown keyword
        ]
        for kwargs in bad:
            with pytest.raises(InvalidCommand):
                g.submit(**kwargs)
            with pytest.raises(InvalidCommand):
                await g(**kwargs)
            assert _snapshot(devs) == before, kwargs
        assert g.statistics().replays == replays
        await trio.sleep(0.05)
        for d in devs:
            await d.synchronize()
        after = [await _read(b) for b in (out, out2, t1, o1)]
        for was, now in zip(contents, after, strict=True):
            np.testing.assert_array_equal(now, was)
        # and the graph still replays fine afterwards
        await g(n=2, k=1)
        want = contents[0].copy()
        want[:2] = x[:2] + 5
        np.testing.assert_array_equal(await _read(out), want)


async def test_variable_out_of_c_parameter_range_sends_nothing(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=10) as d:
        kk = Variable("kk", 0, 2**40)
        addi = _prog(d, "addi", ADDI)
        a, out = _i64(4, d), _i64(4, d)
        await a.copyin(np.arange(4, dtype=I64))
        with hcqa.capture() as g:
            addi(out, a, vals=(kk,))
        await g(kk=7)
        np.testing.assert_array_equal(await _read(out), np.arange(4) + 7)
        before = _snapshot([d])
        with pytest.raises(InvalidCommand):
            g.submit(kk=2**33)  # fits the Variable, not the C int
        assert _snapshot([d]) == before
        np.testing.assert_array_equal(await _read(out), np.arange(4) + 7)


# -- submit() / fences -------------------------------------------------------------------------


async def test_submit_fence_means_whole_replay_done() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=10) as (d0, d1):

        def slow(out: npt.NDArray[Any], v: int) -> None:
            time.sleep(0.05)
            out[:] = v

        p_slow = d0.program("slow", slow)
        lin1 = d1.program("lin", _lin)
        a0, z0 = _i64(4, d0), _i64(4, d0)
        b1, c1 = _i64(4, d1), _i64(4, d1)
        with hcqa.capture() as g:
            p_slow(a0, vals=(5,))
            hcqa.transfer(b1, a0)
            p_slow(z0, vals=(9,))  # independent of the last node, and slow
            lin1(c1, b1, b1, vals=(2,))
        for _ in range(3):
            fence = g.submit()
            assert isinstance(fence, hcqa.Fence)
            with trio.fail_after(10):
                await fence
            # no synchronize: the fence alone says every part of the replay is done
            np.testing.assert_array_equal(z0.numpy_view(), [9] * 4)
            np.testing.assert_array_equal(a0.numpy_view(), [5] * 4)
            np.testing.assert_array_equal(b1.numpy_view(), [5] * 4)
            np.testing.assert_array_equal(c1.numpy_view(), [15] * 4)
            z0.numpy_view()[:] = 0
            c1.numpy_view()[:] = 0


async def test_one_message_per_queue_per_replay(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 2), hang_limit=10) as (d0, d1):
        lin0 = _prog(d0, "lin", _lin)
        a, b = _i64(4, d0), _i64(4, d0)
        t = _i64(4, d1)
        await a.copyin(np.ones(4, I64))
        with hcqa.capture() as g:
            for _ in range(10):
                lin0(b, a, b, vals=(1,))
            d0.copy_queue().copy(a, b, 32).submit()
            hcqa.transfer(t, a)
        await g()
        sent = (d0.compute.sent, d0.copy.sent, d1.compute.sent, d1.copy.sent)
        for _ in range(3):
            await g()
        assert (d0.compute.sent, d0.copy.sent, d1.compute.sent, d1.copy.sent) == (
            sent[0] + 3,
            sent[1] + 3,
            sent[2],
            sent[3] + 3,
        )
        st_ = g.statistics()
        assert (st_.nodes, st_.queues, st_.replays) == (12, 3, 4)


# -- redundant waits, dump -----------------------------------------------------------------------


async def test_redundant_waits_are_dropped_and_dump_is_readable(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 2), hang_limit=10) as (d0, d1):
        lin0 = _prog(d0, "make_x", _lin)
        x0, y0 = _i64(4, d0), _i64(4, d0)
        u1, v1 = _i64(4, d1), _i64(4, d1)
        src = np.array([1, 2, 3, 4], dtype=I64)
        await x0.copyin(src)
        with hcqa.capture() as g:
            lin0(x0, x0, x0, vals=(2,))  # cpu:0 compute: x0 = 3 * x0
            d0.copy_queue().copy(y0, x0, 32).submit()  # cpu:0 copy waits for compute
            hcqa.transfer(u1, y0)  # cpu:1 copy waits for cpu:0 copy (which knows compute)
            hcqa.transfer(v1, x0)  # would wait for cpu:0 compute: already known, dropped
        st_ = g.statistics()
        assert st_.waits_dropped > 0
        assert st_.waits == 2
        assert (st_.nodes, st_.queues, st_.devices) == (4, 3, 2)
        want = src.copy()
        for _ in range(3):
            await g()
            want = want * 3
            for b in (x0, y0, u1, v1):
                np.testing.assert_array_equal(await _read(b), want)
        text = g.dump()
        words = ("make_x", "copy", "transfer")
        for word in (*words, f"{d0.name} compute", f"{d0.name} copy", f"{d1.name} copy"):
            assert word in text, (word, text)
        assert len([line for line in text.splitlines() if line.startswith("  [")]) == 4
        assert "4 nodes" in text
        assert "Graph" in repr(g)


async def test_diamond_across_three_devices(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 3), hang_limit=10) as devs:
        d0, d1, d2 = devs
        lins = [_prog(d, "lin", _lin) for d in devs]
        src0 = _i64(4, d0)
        b1, c1 = _i64(4, d1), _i64(4, d1)
        b2, c2 = _i64(4, d2), _i64(4, d2)
        s0, t0, out0 = _i64(4, d0), _i64(4, d0), _i64(4, d0)
        x = np.array([1, -2, 3, 5], dtype=I64)
        await src0.copyin(x)
        with hcqa.capture() as g:
            lins[0](src0, src0, src0, vals=(0,))  # src0 = src0 (a write)
            hcqa.transfer(b1, src0)
            hcqa.transfer(b2, src0)
            lins[1](c1, b1, b1, vals=(1,))  # 2x
            lins[2](c2, b2, b2, vals=(2,))  # 3x
            hcqa.transfer(s0, c1)
            hcqa.transfer(t0, c2)
            lins[0](out0, s0, t0, vals=(1,))  # 5x
        await g()
        np.testing.assert_array_equal(await _read(out0), x * 5)
        await g()
        np.testing.assert_array_equal(await _read(out0), x * 5)


# -- the native runner ---------------------------------------------------------------------------


async def test_native_runner_fuses_static_c_chain() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=10) as d:
        addk = d.program("addk", ADDK)
        a, b = _i64(8, d), _i64(8, d)
        x = np.arange(8, dtype=I64) - 3
        await a.copyin(x)
        with hcqa.capture() as g:
            for i in range(20):
                if i % 2 == 0:
                    addk(b, a, vals=(1, 8))
                else:
                    addk(a, b, vals=(1, 8))
        assert g.statistics().native_runs == 1
        sent = d.compute.sent
        await g()
        np.testing.assert_array_equal(await _read(a), x + 20)
        np.testing.assert_array_equal(await _read(b), x + 19)
        await g()
        np.testing.assert_array_equal(await _read(a), x + 40)
        assert d.compute.sent == sent + 2
        assert g.statistics().native_runs == 1  # nothing rebuilt per replay


async def test_native_runner_split_by_python_and_symbolic_kernels() -> None:
    async with hcqa.open_device("cpu:0", hang_limit=10) as d:
        addk = d.program("addk", ADDK)
        lin = d.program("lin", _lin)
        n = Variable("n", 1, 8)
        a, b = _i64(8, d), _i64(8, d)
        x = np.arange(8, dtype=I64)
        await a.copyin(x)
        await b.copyin(np.zeros(8, I64))
        with hcqa.capture() as g:
            for _ in range(10):
                addk(a, a, vals=(1, 8))
            lin(a, a, b, vals=(2,))  # a = 2a + b
            for _ in range(5):
                addk(a, a, vals=(1, 8))
            addk(b, a, vals=(0, n))  # symbolic: fused too, its table entry filled per replay
            for _ in range(3):
                addk(a, a, vals=(1, 8))
        assert g.statistics().native_runs == 2  # split by the Python kernel only
        await g(n=4)
        want_a = (x + 10) * 2 + 5
        want_b = np.zeros(8, I64)
        want_b[:4] = want_a[:4]
        want_a = want_a + 3
        np.testing.assert_array_equal(await _read(a), want_a)
        np.testing.assert_array_equal(await _read(b), want_b)


# -- faults -------------------------------------------------------------------------------------


async def test_fault_in_replay_is_one_device_fault_shared_across_devices() -> None:
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=10) as (d0, d1):

        def boom(out: npt.NDArray[Any]) -> None:
            time.sleep(0.05)  # let the replay's watchers park first
            raise ValueError("boom in a replay")

        p_boom = d0.program("boom", boom)
        lin1 = d1.program("lin", _lin)
        a0, z0 = _i64(4, d0), _i64(4, d0)
        b1, c1 = _i64(4, d1), _i64(4, d1)
        await c1.copyin(np.full(4, 11, I64))
        with hcqa.capture() as g:
            p_boom(a0)
            d0.copy_queue().copy(z0, a0, 32).submit()  # cpu:0 copy waits for the kernel
            hcqa.transfer(b1, a0)
            lin1(c1, b1, b1, vals=(1,))
        with trio.fail_after(5), pytest.raises(DeviceFault) as info:
            await g()
        fault = info.value
        assert type(fault) is DeviceFault  # one fault, not an ExceptionGroup
        assert isinstance(fault.__cause__, ValueError)
        assert "boom in a replay" in str(fault.__cause__)
        assert "boom" in str(fault)
        # the transfer's device faulted with the very same instance
        assert d0.faulted is fault
        assert d1.faulted is fault
        for d in (d0, d1):
            with pytest.raises(DeviceFault) as again:
                await d.synchronize()
            assert again.value is fault
        # a later replay (or eager call) on a faulted device raises the fault at once
        with pytest.raises(DeviceFault) as later:
            g.submit()
        assert later.value is fault
        assert c1.numpy_view().tolist() == [11] * 4  # the consumer never ran
    # observed: not raised again when the devices close


async def test_fault_cancels_siblings_and_spares_independent_device() -> None:
    gate = threading.Event()
    try:
        async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=10) as (d0, d1):

            def held(out: npt.NDArray[Any]) -> None:
                gate.wait(5)
                out[:] = 1

            def boom(out: npt.NDArray[Any]) -> None:
                raise RuntimeError("sibling fault")

            p_held = d1.program("held", held)
            p_boom = d0.program("boom", boom)
            a0, b1 = _i64(4, d0), _i64(4, d1)
            with hcqa.capture() as g:
                p_held(b1)  # independent of the fault, held until the gate opens
                p_boom(a0)
            start = time.monotonic()
            with trio.fail_after(3), pytest.raises(DeviceFault) as info:
                await g()
            assert time.monotonic() - start < 3
            assert not gate.is_set()  # the fault came back while the sibling still ran
            assert isinstance(info.value.__cause__, RuntimeError)
            gate.set()
            with trio.fail_after(5):
                await d1.synchronize()
            assert d1.faulted is None
            np.testing.assert_array_equal(await _read(b1), [1] * 4)
            with pytest.raises(DeviceFault):
                await d0.synchronize()
    finally:
        gate.set()


async def test_several_different_faults_are_all_device_faults() -> None:
    barrier = threading.Barrier(2, timeout=5)
    async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=10) as (d0, d1):

        def boom(out: npt.NDArray[Any]) -> None:
            barrier.wait()
            raise ValueError(f"boom {out.shape}")

        p0, p1 = d0.program("boom0", boom), d1.program("boom1", boom)
        a0, a1 = _i64(4, d0), _i64(4, d1)
        with hcqa.capture() as g:
            p0(a0)
            p1(a1)
        with trio.fail_after(5):
            try:
                await g()
            except DeviceFault as exc:
                errors: list[BaseException] = [exc]
            except ExceptionGroup as group:
                errors = list(group.exceptions)
                assert len(errors) >= 2
                assert len({id(e) for e in errors}) == len(errors)  # several *different*
            else:
                pytest.fail("the replay did not raise")
        for e in errors:
            assert isinstance(e, DeviceFault)
            assert isinstance(e.__cause__, ValueError)
        for d in (d0, d1):
            with pytest.raises(DeviceFault):
                await d.synchronize()


# -- cancellation -------------------------------------------------------------------------------


async def test_cancelling_the_awaiting_task_leaves_devices_usable() -> None:
    gate = threading.Event()
    try:
        async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=10) as (d0, d1):

            def gated(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
                gate.wait(5)
                out[:] = a + 1

            p_gated = d0.program("gated", gated)
            lin0, lin1 = d0.program("lin", _lin), d1.program("lin", _lin)
            a0, b0 = _i64(4, d0), _i64(4, d0)
            t1, c1 = _i64(4, d1), _i64(4, d1)
            x = np.array([3, 1, 4, 1], dtype=I64)
            await a0.copyin(x)
            with hcqa.capture() as g:
                p_gated(b0, a0)
                hcqa.transfer(t1, b0)
                lin1(c1, t1, t1, vals=(1,))
            with trio.move_on_after(0.1) as scope:
                await g()
            assert scope.cancelled_caught
            assert not gate.is_set()
            gate.set()
            with trio.fail_after(5):
                await d0.synchronize()
                await d1.synchronize()
            # the cancelled replay still completed on the devices
            np.testing.assert_array_equal(await _read(c1), (x + 1) * 2)
            # eager work runs
            with trio.fail_after(5):
                await lin0(a0, a0, a0, vals=(1,))
                await lin1(t1, t1, t1, vals=(0,))
            np.testing.assert_array_equal(await _read(a0), x * 2)
            # and a later replay is right
            with trio.fail_after(5):
                await g()
            np.testing.assert_array_equal(await _read(c1), (x * 2 + 1) * 2)
            assert d0.faulted is None and d1.faulted is None
    finally:
        gate.set()


# -- concurrent replays --------------------------------------------------------------------------


async def test_concurrent_replays_from_several_tasks_serialize(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 2), hang_limit=10) as (d0, d1):

        def inc(acc: npt.NDArray[Any]) -> None:
            acc[:] = acc + 1

        p_inc = _prog(d0, "inc", inc)
        p_acc = _prog(d1, "acc", _acc)
        acc0 = _i64(4, d0)
        t1, sum1 = _i64(4, d1), _i64(4, d1)
        await acc0.copyin(np.zeros(4, I64))
        await sum1.copyin(np.zeros(4, I64))
        with hcqa.capture() as g:
            p_inc(acc0)
            hcqa.transfer(t1, acc0)
            p_acc(sum1, t1)

        async def replayer(i: int) -> None:
            for j in range(10):
                if (i + j) % 3 == 0:
                    g.submit()
                    await trio.lowlevel.checkpoint()
                else:
                    await g()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(replayer, i)
            await d0.synchronize()
            await d1.synchronize()
        total = 50
        np.testing.assert_array_equal(await _read(acc0), [total] * 4)
        # each replay's transfer saw exactly its own increment
        np.testing.assert_array_equal(await _read(sum1), [total * (total + 1) // 2] * 4)
        assert g.statistics().replays == total


# -- the graph boundary against eager work ------------------------------------------------


async def test_eager_write_replay_eager_read_without_awaits(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 2), hang_limit=10) as (d0, d1):

        def slow_lin(out: npt.NDArray[Any], a: npt.NDArray[Any], k: int) -> None:
            time.sleep(0.01)
            out[:] = a * k

        p0 = _prog(d0, "slow_lin", slow_lin)
        lin1 = _prog(d1, "lin", _lin)
        a0, b0 = _i64(4, d0), _i64(4, d0)
        c1, e1 = _i64(4, d1), _i64(4, d1)
        with hcqa.capture() as g:
            p0(b0, a0, vals=(3,))  # reads a0 (written eagerly on cpu:0 copy)
            hcqa.transfer(c1, b0)
        inputs = [np.arange(4, dtype=I64) + 10 * i for i in range(4)]
        results = [np.zeros(4, I64) for _ in inputs]
        after_b0 = np.zeros(4, I64)
        for x, res in zip(inputs, results, strict=True):
            a0.copyin(x)  # eager write on another queue than the graph's reader
            g.submit()
            lin1(e1, c1, c1, vals=(1,))  # eager read of the replay's output (cpu:1 compute)
            e1.copyout(res)  # eager read on cpu:1 copy
        a0.copyin(np.full(4, -1, I64))  # eager overwrite after the last replay (WAR)
        b0.copyout(after_b0)
        with trio.fail_after(10):
            await d0.synchronize()
            await d1.synchronize()
        for x, res in zip(inputs, results, strict=True):
            np.testing.assert_array_equal(res, x * 3 * 2)
        np.testing.assert_array_equal(after_b0, inputs[-1] * 3)
        np.testing.assert_array_equal(await _read(a0), [-1] * 4)


# -- errors -------------------------------------------------------------------------------------


async def test_capture_errors(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=10) as d:
        lin = _prog(d, "lin", _lin)
        a = _i64(4, d)
        await a.copyin(np.ones(4, I64))

        # a replay before the capture ends, and a nested capture
        with hcqa.capture() as g:
            fence = lin(a, a, a, vals=(1,))
            assert isinstance(fence, hcqa.Fence)
            assert not fence.reached
            with pytest.raises(InvalidCommand):
                g.submit()
            with pytest.raises(InvalidCommand):
                await g()
            with pytest.raises(InvalidCommand), hcqa.capture():
                pass
            with pytest.raises(InvalidCommand):
                await fence  # a captured fence can't be awaited, even inside the block
        # awaiting a fence returned during capture, after the block
        with pytest.raises(InvalidCommand):
            await fence
        with pytest.raises(InvalidCommand):
            with trio.fail_after(1):
                await fence.wait()
        assert g.statistics().nodes == 1
        np.testing.assert_array_equal(await _read(a), [1] * 4)  # capturing ran nothing
        await g()
        np.testing.assert_array_equal(await _read(a), [2] * 4)

        # inside another capture a graph is recorded there; awaiting it is refused
        with hcqa.capture() as other:
            with pytest.raises(InvalidCommand, match="can't be awaited inside a capture"):
                await g()
            g.submit()
            lin(a, a, a, vals=(1,))
        assert other.statistics().nodes == g.statistics().nodes + 1

        # a graph with no work
        with hcqa.capture() as empty:
            pass
        assert empty.statistics().nodes == 0
        with pytest.raises(InvalidCommand):
            empty.submit()
        with pytest.raises(InvalidCommand):
            await empty()
        assert "0 nodes" in empty.dump()

        # the capture ends with the block even when it raises; the graph is unusable
        with pytest.raises(RuntimeError), hcqa.capture() as broken:
            lin(a, a, a, vals=(1,))
            raise RuntimeError("body failed")
        with pytest.raises(InvalidCommand):
            broken.submit()
        with trio.fail_after(5):
            await lin(a, a, a, vals=(1,))  # eager again: really runs
        np.testing.assert_array_equal(await _read(a), [4] * 4)
    with pytest.raises(hcqa.DeviceClosed):
        g.submit()


async def test_capture_records_host_copies_and_replays_them(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 2), hang_limit=10) as (d0, d1):
        lin0 = _prog(d0, "lin", _lin)
        a0, b0 = _i64(4, d0), _i64(4, d0)
        t1 = _i64(4, d1)
        host_in = np.array([1, 2, 3, 4], dtype=I64)
        host_out = np.zeros(4, I64)
        with hcqa.capture() as g:
            a0.copyin(host_in)
            lin0(b0, a0, a0, vals=(1,))
            hcqa.transfer(t1, b0)
            t1.copyout(host_out)
        assert host_out.tolist() == [0] * 4
        await g()
        np.testing.assert_array_equal(host_out, host_in * 2)
        host_in[:] = [5, 6, 7, 8]  # the replay reads the host array as it is now
        await g()
        np.testing.assert_array_equal(host_out, host_in * 2)


# -- regressions: bugs these tests found, now fixed --------------------------------------


async def test_unwaited_transfer_before_waited_node_keeps_order(kind: str) -> None:
    async with hcqa.open_devices(*specs(kind, 3), hang_limit=10) as (d0, d1, d2):

        def slow(out: npt.NDArray[Any], v: int) -> None:
            time.sleep(0.2)
            out[:] = v

        def cp(out: npt.NDArray[Any], a: npt.NDArray[Any]) -> None:
            out[:] = a

        p_slow = d2.program("slow", slow) if kind == "cpu" else _prog(d2, "fill", None)
        p_cp = _prog(d1, "cp", cp)
        a0 = _i64(4, d0)
        b1, c1, o1 = _i64(4, d1), _i64(4, d1), _i64(4, d1)
        s2 = _i64(4, d2)
        with hcqa.capture() as g:
            hcqa.transfer(b1, a0)  # cpu:1 copy, nobody waits for it
            p_slow(s2, vals=(7,))
            hcqa.transfer(c1, s2)  # cpu:1 copy, waited for by cp
            p_cp(o1, c1)  # cpu:1 compute
        await g()
        np.testing.assert_array_equal(await _read(o1), [7] * 4)


async def test_replay_after_free_is_refused(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=10) as d:

        def fill(out: npt.NDArray[Any], k: int) -> None:
            out[:] = k

        p = _prog(d, "fill", fill)
        a = _i64(4, d)
        with hcqa.capture() as g:
            p(a, vals=(7,))
        await g()
        a.free()
        b = _i64(4, d)  # the caching allocator hands the same memory out again
        await b.copyin(np.zeros(4, I64))
        with pytest.raises(InvalidCommand):
            await g()
        np.testing.assert_array_equal(await _read(b), [0] * 4)


async def test_unawaited_replay_fault_is_raised_at_close() -> None:
    def boom(out: npt.NDArray[Any]) -> None:
        raise ValueError("nobody awaited me")

    with pytest.raises(DeviceFault):
        async with hcqa.open_devices("cpu:0", "cpu:1", hang_limit=10) as (d0, d1):
            p = d0.program("boom", boom)
            a0, b1 = _i64(4, d0), _i64(4, d1)
            with hcqa.capture() as g:
                p(a0)
                hcqa.transfer(b1, a0)
            g.submit()  # never awaited


async def test_dump_names_copyout(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=10) as d:
        a = _i64(4, d)
        out = np.zeros(4, I64)
        with hcqa.capture() as g:
            a.copyin(np.ones(4, I64))
            a.copyout(out)
        text = g.dump()
        assert "copyin" in text
        assert "copyout" in text and "transfer" not in text, text


async def test_submit_async_is_captured_with_variables(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=10) as d:
        addk = _prog(d, "addk", ADDK)
        n = Variable("n", 1, 4)
        a, out = _i64(4, d), _i64(4, d)
        await a.copyin(np.arange(4, dtype=I64))
        await out.copyin(np.zeros(4, I64))
        q = d.compute_queue().exec(addk, (out, a), vals=(1, n))
        with hcqa.capture() as g:
            await q.submit_async()
        await g(n=2)
        np.testing.assert_array_equal(await _read(out), [1, 2, 0, 0])


async def test_timed_inside_capture_records_nothing(kind: str) -> None:
    async with hcqa.open_device(spec(kind), hang_limit=10) as d:
        lin = _prog(d, "lin", _lin)
        a = _i64(4, d)
        with hcqa.capture() as g:
            with pytest.raises(InvalidCommand):
                await lin.timed(a, a, a, vals=(1,))
        assert g.statistics().nodes == 0
