"""Launch geometry reaches kernels (issue 17): Python keyword-only parameters, the C
``geometry=True`` convention, and refusal where a kernel can't receive it."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio

import hcqa
from hcqa.errors import InvalidCommand

TIMEOUT = 20.0

C_GEOMETRY = """
#include <stdint.h>
void geo(int32_t *out, int k, int gx, int gy, int gz, int lx, int ly, int lz) {
    out[0] = gx; out[1] = gy; out[2] = gz; out[3] = lx; out[4] = ly; out[5] = lz; out[6] = k;
}
"""

C_PLAIN = """
#include <stdint.h>
void plain(int32_t *out, int k) { out[0] = k; }
"""


def _recorder(seen: list[Any]) -> Any:
    def k(out: npt.NDArray[Any], *, global_size: Any, local_size: Any) -> None:
        seen.append((global_size, local_size))
        out[0] += 1

    return k


async def test_python_kernel_receives_resolved_geometry() -> None:
    seen: list[Any] = []
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("k", _recorder(seen))
            out = d.alloc(8)
            await prog(out, global_size=64, local_size=(8, 2))
            await prog(out)
            n = hcqa.Variable("n", 1, 1024)
            q = d.compute_queue().exec(
                prog, (out,), global_size=(n, 2, 1), local_size=(n // 2, 1, 1)
            )
            await q.submit({n: 16})
            await q.submit({n: 4})
    assert seen == [
        ((64, 1, 1), (8, 2, 1)),
        ((1, 1, 1), (1, 1, 1)),
        ((16, 2, 1), (8, 1, 1)),
        ((4, 2, 1), (2, 1, 1)),
    ]
    assert all(type(x) is int for g in seen for t in g for x in t)


async def test_graph_replay_passes_each_replays_geometry() -> None:
    seen: list[Any] = []
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("k", _recorder(seen))
            out = d.alloc(8)
            n = hcqa.Variable("n", 1, 1024)
            with hcqa.capture() as g:
                prog(out, global_size=(n, 1, 1), local_size=4)
            await g(n=32)
            await g(n=7)
    assert seen == [((32, 1, 1), (4, 1, 1)), ((7, 1, 1), (4, 1, 1))]


async def test_kernel_declaring_only_global_size() -> None:
    seen: list[Any] = []

    def k(out: npt.NDArray[Any], *, global_size: Any) -> None:
        seen.append(global_size)

    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("k", k)
            out = d.alloc(8)
            await prog(out, global_size=(3, 4, 5))
            reserved = d.statistics().timeline_reserved
            with pytest.raises(InvalidCommand, match="can't receive 'local_size'"):
                prog(out, global_size=3, local_size=(2, 1, 1))
            assert d.statistics().timeline_reserved == reserved  # nothing was queued
    assert seen == [(3, 4, 5)]


async def test_geometry_is_refused_where_it_cannot_be_received() -> None:
    calls: list[int] = []

    def plain(out: npt.NDArray[Any], k: int) -> None:
        calls.append(k)

    def positional(out: npt.NDArray[Any], global_size: Any = None) -> None:
        calls.append(-1)  # a positional parameter of that name is not the convention

    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            out = d.alloc(32)
            py = d.program("plain", plain)
            c = d.program("plain", C_PLAIN)
            pos = d.program("positional", positional)
            for prog, vals in ((py, (1,)), (c, (1,)), (pos, (0,))):
                for kw in ({"global_size": (64, 1, 1)}, {"local_size": 2}):
                    with pytest.raises(InvalidCommand, match=r"must be \(1, 1, 1\)"):
                        prog(out, vals=vals, **kw)
            await py(out, vals=(5,), global_size=(1, 1, 1), local_size=1)  # (1,1,1) is fine
            # a symbolic size is checked once resolved: at submit, before anything is sent
            n = hcqa.Variable("n", 1, 64)
            q = d.compute_queue().exec(py, (out,), global_size=(n, 1, 1), vals=(6,))
            await q.submit({n: 1})
            reserved = d.statistics().timeline_reserved
            with pytest.raises(InvalidCommand, match="can't receive 'global_size'"):
                q.submit({n: 8})
            with hcqa.capture() as g:
                py(out, vals=(7,), local_size=(1, n, 1))
            with pytest.raises(InvalidCommand, match="can't receive 'local_size'"):
                g.submit(n=2)
            assert d.statistics().timeline_reserved == reserved
            await g(n=1)
    assert calls == [5, 6, 7]


C_COUNT = """
#include <stdint.h>
void count(int32_t *out, int k) { out[k] += 1; }
"""


@pytest.mark.parametrize("between", [False, True])
async def test_graph_refuses_a_symbolic_size_a_plain_c_kernel_cannot_receive(
    between: bool,
) -> None:
    """A plain C kernel (no geometry=True) captured with a Variable launch size: each
    replay resolves and checks it as a Queue submit does -- a size other than (1, 1, 1)
    or out of the Variable's range is InvalidCommand before anything runs, never dropped;
    (1, 1, 1) runs. Alone, or between two fusable C kernels (the capture must not fail)."""
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("count", C_COUNT)
            out = d.alloc(shape=(3,), dtype="int32")
            await out.copyin(np.zeros(3, np.int32))
            n = hcqa.Variable("n", 1, 64)
            with hcqa.capture() as g:
                if between:
                    prog(out, vals=(0,))
                prog(out, vals=(1,), global_size=(n, 1, 1))
                prog(out, vals=(1,), local_size=(1, n, 1))
                if between:
                    prog(out, vals=(2,))
            reserved = d.statistics().timeline_reserved
            for v, match in (
                (8, r"can't receive 'global_size': it must be \(1, 1, 1\) \(got \(8, 1, 1\)\)"),
                (0, r"variable 'n' must be in \[1, 64\] \(got 0\)"),
            ):
                with pytest.raises(InvalidCommand, match=match):
                    await g(n=v)
            assert d.statistics().timeline_reserved == reserved  # nothing was queued
            host = np.empty(3, np.int32)
            await out.copyout(host)
            assert host.tolist() == [0, 0, 0]
            await g(n=1)
            await out.copyout(host)
            assert host.tolist() == ([1, 2, 1] if between else [0, 2, 0])
            q = d.compute_queue().exec(prog, (out,), vals=(1,), global_size=(n, 1, 1))
            with pytest.raises(InvalidCommand, match="can't receive 'global_size'"):
                q.submit({n: 8})  # the Queue path refuses alike


async def test_c_kernel_with_geometry_true_gets_six_trailing_ints() -> None:
    with trio.fail_after(TIMEOUT):
        async with hcqa.open_device("cpu:0") as d:
            prog = d.program("geo", C_GEOMETRY, geometry=True)
            assert (prog.n_buffers, prog.n_vals) == (1, 1)
            out = d.alloc(shape=(7,), dtype="int32")
            host = np.zeros(7, np.int32)
            await prog(out, vals=(9,), global_size=(128, 2), local_size=32)
            await out.copyout(host)
            assert host.tolist() == [128, 2, 1, 32, 1, 1, 9]
            with pytest.raises(InvalidCommand, match="takes 1 buffers and 1 vals"):
                prog(out, vals=(1, 2, 3, 4, 5, 6, 7))
            # graphs: fixed geometry is fused (native run), symbolic geometry patched
            n = hcqa.Variable("n", 1, 4096)
            other = d.alloc(shape=(7,), dtype="int32")
            with hcqa.capture() as g:
                prog(out, vals=(1,), global_size=(4, 5, 6), local_size=(1, 2, 3))
                prog(other, vals=(2,), global_size=(7, 8, 9), local_size=(3, 2, 1))
            assert g.statistics().native_runs == 1
            await g()
            await out.copyout(host)
            assert host.tolist() == [4, 5, 6, 1, 2, 3, 1]
            await other.copyout(host)
            assert host.tolist() == [7, 8, 9, 3, 2, 1, 2]
            with hcqa.capture() as g2:
                prog(out, vals=(3,), global_size=(n, 1, 1), local_size=(n // 4, 1, 1))
            for v in (64, 12):
                await g2(n=v)
                await out.copyout(host)
                assert host.tolist() == [v, 1, 1, v // 4, 1, 1, 3]
            # ranges of the geometry parameters are C int ranges
            with pytest.raises(InvalidCommand, match="geometry parameter 'gx'"):
                prog(out, vals=(1,), global_size=(2**31, 1, 1))


async def test_geometry_option_is_checked() -> None:
    async with hcqa.open_device("cpu:0") as d:
        with pytest.raises(InvalidCommand, match="must end with 6 int parameters"):
            d.program("plain", C_PLAIN, geometry=True)
        with pytest.raises(InvalidCommand, match="'geometry' is for C kernels"):
            d.program("py", lambda out: None, geometry=True)
        with pytest.raises(TypeError, match="'geometry' must be a bool"):
            d.program("geo", C_GEOMETRY, geometry=1)  # type: ignore[arg-type]
