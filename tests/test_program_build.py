"""Building programs: ``program(..., flags=)`` and ``program_async`` (the build off the loop).

A cold C compile or OpenCL build takes tens of milliseconds to a second; ``program_async``
runs it in a worker thread, so the event loop keeps serving meanwhile. The tests prove it
with a heartbeat task that must keep ticking while a cold build (a source no cache has seen)
runs, and, for C, with a compiler that can only finish once a trio task has run.
"""

from __future__ import annotations

import asyncio
import stat
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from _kinds import opencl_missing

import hcqa
from hcqa._native.compiler import compile_c
from hcqa.devices.cpu import crunner
from hcqa.errors import InvalidCommand

VALUE_C = """
void value(int *out) { out[0] = VALUE; }
"""
VALUE_CL = """
__kernel void value(__global int *out) { out[0] = VALUE; }
"""


def _needs_opencl() -> None:
    why = opencl_missing()
    if why is not None:
        pytest.skip(why)


def _cold(src: str) -> str:
    """``src`` with a unique comment: no cache (hcqa's, PoCL's) has built it before."""
    return f"/* {uuid.uuid4().hex} */\n{src}"


async def _read(buf: hcqa.Buffer) -> int:
    out = np.zeros(1, np.int32)
    await buf.copyout(out)
    return int(out[0])


@pytest.fixture
def c_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private C kernel cache for the test (cold, and nothing left in the user's)."""
    path = tmp_path / "kernels"
    monkeypatch.setenv("HCQA_CACHE_DIR", str(path))
    return path


# -- flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ("-O3", "must be a tuple of str"),
        (None, "must be a tuple of str"),
        ((b"-O3",), "must hold str"),
        ((3,), "must hold str"),
        (("-DX=1\0",), "without NUL"),
        (("",), "non-empty"),
    ],
)
async def test_bad_flags_are_refused(flags: Any, match: str) -> None:
    async with hcqa.open_device("cpu:0") as d:
        with pytest.raises(InvalidCommand, match=match):
            d.program("value", VALUE_C, flags=flags)
        with pytest.raises(InvalidCommand, match=match):
            await d.program_async("value", VALUE_C, flags=flags)
        with pytest.raises(InvalidCommand, match="'flags' is for C source only"):
            d.program("py", lambda out: None, flags=("-O3",))
        out = d.alloc(4)  # the device is usable afterwards
        await d.program("value", VALUE_C, flags=["-DVALUE=3"])(out)
        assert await _read(out) == 3


async def test_c_flags_reach_the_compiler_and_key_the_cache(c_cache: Path) -> None:
    """Two programs of one source with different flags are two libraries: the flags are
    part of the cache key, so the second never reuses the first's."""
    async with hcqa.open_device("cpu:0") as d:
        out = d.alloc(4)
        for v in (7, 8, 7):
            prog = await d.program_async("value", VALUE_C, flags=(f"-DVALUE={v}",))
            await prog(out)
            assert await _read(out) == v
        # a later -O or -std wins over hcqa's own (-std=c11 ... -O2): gnu99 allows typeof
        gnu = "void value(int *out) { typeof(*out) v = 5; out[0] = v; }"
        await d.program("value", gnu, flags=("-std=gnu99",))(out)
        assert await _read(out) == 5
        with pytest.raises(InvalidCommand, match="C compile of 'value' failed"):
            d.program("value", VALUE_C, flags=("--no-such-flag-hcqa",))


async def test_opencl_build_options_reach_the_driver() -> None:
    _needs_opencl()
    async with hcqa.open_device("opencl:0") as d:
        out = d.alloc(4)
        for v in (4, 9):
            prog = await d.program_async("value", VALUE_CL, flags=(f"-DVALUE={v}",))
            await prog(out)
            assert await _read(out) == v
        with pytest.raises(InvalidCommand, match="OpenCL build of 'value' failed"):
            await d.program_async("value", VALUE_CL, flags=("-no-such-option-hcqa",))
        await d.program("value", VALUE_CL, flags=("-DVALUE=1",))(out)
        assert await _read(out) == 1


# -- off the loop -----------------------------------------------------------------------------


class Heartbeat:
    """A task that ticks every millisecond or two while the loop is free."""

    def __init__(self) -> None:
        self.ticks = 0

    async def run(self) -> None:
        while True:
            await trio.sleep(0.002)
            self.ticks += 1


async def _ticks_during(build: Callable[[], Any]) -> tuple[int, Any]:
    beat = Heartbeat()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(beat.run)
        await trio.testing.wait_all_tasks_blocked()
        before = beat.ticks
        result = await build()
        during = beat.ticks - before
        nursery.cancel_scope.cancel()
    return during, result


async def test_a_cold_c_compile_does_not_block_the_loop(c_cache: Path) -> None:
    async with hcqa.open_device("cpu:0") as d:
        src = _cold(VALUE_C)
        ticks, prog = await _ticks_during(
            lambda: d.program_async("value", src, flags=("-DVALUE=2",))
        )
        assert ticks >= 3, f"the loop stood still during a cold compile ({ticks} ticks)"
        out = d.alloc(4)
        await prog(out)
        assert await _read(out) == 2


async def test_a_cold_pocl_build_does_not_block_the_loop() -> None:
    _needs_opencl()
    async with hcqa.open_device("opencl:0") as d:
        src = _cold(VALUE_CL)
        ticks, prog = await _ticks_during(
            lambda: d.program_async("value", src, flags=("-DVALUE=6",))
        )
        assert ticks >= 3, f"the loop stood still during a cold build ({ticks} ticks)"
        out = d.alloc(4)
        await prog(out)
        assert await _read(out) == 6


def _gated_compiler(tmp_path: Path) -> tuple[str, Path]:
    """A C compiler that compiles only once the file ``gate`` exists (it gives up after
    ~20 s): a compile on the loop's thread can never see a trio task open it."""
    gate = tmp_path / "gate"
    script = tmp_path / "gated-cc"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then exec cc "$@"; fi\n'
        "i=0\n"
        f'while [ ! -e "{gate}" ]; do\n'
        "  sleep 0.01; i=$((i + 1)); if [ $i -gt 2000 ]; then exit 3; fi\n"
        "done\n"
        'exec cc "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), gate


async def test_the_compile_runs_while_trio_tasks_run(
    tmp_path: Path, c_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cc, gate = _gated_compiler(tmp_path)
    monkeypatch.setenv("CC", cc)
    async with hcqa.open_device("cpu:0") as d:
        got: list[hcqa.Program] = []

        async def build() -> None:
            got.append(await d.program_async("value", _cold(VALUE_C), flags=("-DVALUE=11",)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(build)
            await trio.testing.wait_all_tasks_blocked()
            gate.touch()  # only a free loop gets here while the compiler waits
        out = d.alloc(4)
        await got[0](out)
        assert await _read(out) == 11


async def test_a_fused_queues_first_submit_compiles_nothing_on_the_loop(
    c_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """program_async also loads what a fused queue's first submit needs (the generic runner,
    the kernel's trampoline): every compile and load happens off the loop's thread."""
    on_loop: list[str] = []
    real = compile_c
    loop_thread = threading.get_ident()

    def watched(source: str, entry: str, **kw: Any) -> Any:
        if threading.get_ident() == loop_thread:
            on_loop.append(entry)
        return real(source, entry, **kw)

    monkeypatch.setattr(crunner, "compile_c", watched)
    crunner.generic_entry.cache_clear()
    monkeypatch.setattr(crunner, "_TRAMPOLINES", {})
    async with hcqa.open_device("cpu:0") as d:
        prog = await d.program_async("value", _cold(VALUE_C), flags=("-DVALUE=5",))
        a, b = d.alloc(4), d.alloc(4)
        q = d.compute_queue().exec(prog, (a,)).exec(prog, (b,))
        await q.submit()
        await q.submit()  # fused from the second submit (a constant queue): a generic runner
        assert await _read(b) == 5
        assert q._fused, "the queue was not sent fused"
    assert on_loop == []
    assert crunner.generic_entry.cache_info().currsize == 1


def test_program_async_under_asyncio(c_cache: Path) -> None:
    async def main() -> int:
        ticks = 0

        async def beat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.002)
                ticks += 1

        async with hcqa.open_device("cpu:0") as d:
            task = asyncio.create_task(beat())
            await asyncio.sleep(0.01)
            before = ticks
            prog = await d.program_async("value", _cold(VALUE_C), flags=("-DVALUE=12",))
            during = ticks - before
            task.cancel()
            out = d.alloc(4)
            await prog(out)
            word = np.zeros(1, np.int32)
            await out.copyout(word)
            assert during >= 3, f"the asyncio loop stood still during a compile ({during})"
            with pytest.raises(InvalidCommand, match="must be a tuple"):
                await d.program_async("value", VALUE_C, flags="-O3")
            return int(word[0])

    assert asyncio.run(asyncio.wait_for(main(), 60)) == 12


async def test_a_graph_capture_compiles_nothing_on_the_loop(
    c_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ending a capture fuses the graph's runs of C kernels; with a cold compiler cache,
    nothing is compiled on the loop's thread for it (the runs use the generic runner that
    program_async loaded), and the replays compute what they should."""
    on_loop: list[str] = []
    real = compile_c
    loop_thread = threading.get_ident()

    def watched(source: str, entry: str, **kw: Any) -> Any:
        if threading.get_ident() == loop_thread:
            on_loop.append(entry)
        return real(source, entry, **kw)

    monkeypatch.setattr(crunner, "compile_c", watched)
    crunner.generic_entry.cache_clear()
    monkeypatch.setattr(crunner, "_TRAMPOLINES", {})
    async with hcqa.open_device("cpu:0") as d:
        prog = await d.program_async("value", _cold(VALUE_C), flags=("-DVALUE=7",))
        a, b, c = d.alloc(4), d.alloc(4), d.alloc(4)
        with hcqa.capture() as g:
            prog(a)
            prog(b)
            prog(c)
        assert on_loop == []
        assert g.statistics().native_runs >= 1, "the capture fused nothing"
        await g()
        await g()
        assert [await _read(x) for x in (a, b, c)] == [7, 7, 7]
    assert on_loop == []
