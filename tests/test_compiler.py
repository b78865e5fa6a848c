"""Tests for hcqa._native.compiler: C signature parsing, compiling, caching, calling."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hcqa._native.compiler import CKernel, CParam, compile_c, parse_signature
from hcqa.errors import InvalidCommand

ADD1 = """
void add1(float *out, const float *a, int n) {
    for (int i = 0; i < n; i++) out[i] = a[i] + 1.0f;
}
"""

SPIN = """
#define _POSIX_C_SOURCE 199309L
#include <time.h>
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
void spin(int ms) {
    double end = now() + ms * 1e-3;
    while (now() < end) {}
}
"""


def sig(source: str, entry: str) -> list[tuple[str, bool, type]]:
    return [(p.name, p.pointer, p.ctype) for p in parse_signature(source, entry)]


def test_add1_runs_on_numpy_arrays(tmp_path: Path) -> None:
    k = compile_c(ADD1, "add1", cache_dir=tmp_path)
    assert (k.name, k.n_buffers, k.n_vals) == ("add1", 2, 1)
    assert Path(k.path).parent == tmp_path and k.path.endswith(".so")
    assert k.address == ctypes.cast(k.fn, ctypes.c_void_p).value and k.address != 0
    a = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    out = np.zeros_like(a)
    k.fn(out.ctypes.data, a.ctypes.data, 999)
    np.testing.assert_array_equal(out[:999], a[:999] + np.float32(1))
    assert out[999] == 0


def test_parse_signature_types_comments_and_lines() -> None:
    src = """
    #include <stdint.h>
    #include <stddef.h>
    /* void k(float f) { } -- a comment, not the definition */
    // void k(double d) {
    const char *msg = "void k(float x) { /* not a comment */";
    void k(float x, int y);   /* a prototype is not the definition */
    extern __attribute__((visibility("default"), noinline)) void
    k(  float *restrict out,          // the output
        const float *const a,
        void *raw, double __restrict__ *d, int arr[],
        unsigned n, size_t m, int64_t big,
        unsigned long long ull, long l, short s, unsigned short us,
        unsigned char c, signed char sc, char ch, uint32_t u32, int32_t i32,
        ssize_t ss, uint64_t u64, const unsigned int cu, long int li)
    {
        out[0] = a[0];
    }
    """
    c = ctypes
    assert sig(src, "k") == [
        ("out", True, c.c_void_p), ("a", True, c.c_void_p), ("raw", True, c.c_void_p),
        ("d", True, c.c_void_p), ("arr", True, c.c_void_p), ("n", False, c.c_uint),
        ("m", False, c.c_uint64), ("big", False, c.c_int64), ("ull", False, c.c_ulonglong),
        ("l", False, c.c_int64), ("s", False, c.c_short), ("us", False, c.c_ushort),
        ("c", False, c.c_ubyte), ("sc", False, c.c_byte), ("ch", False, c.c_byte),
        ("u32", False, c.c_uint32), ("i32", False, c.c_int32), ("ss", False, c.c_int64),
        ("u64", False, c.c_uint64), ("cu", False, c.c_uint), ("li", False, c.c_int64),
    ]  # fmt: skip


def test_parse_signature_no_params_and_similar_names() -> None:
    src = "void add10(int *x) { }\nvoid xadd1(int *y) { }\nvoid add1(void) { add10(0); }\n"
    assert sig(src, "add1") == []
    assert sig("void f() {}", "f") == []
    assert sig(src, "add10") == [("x", True, ctypes.c_void_p)]


@pytest.mark.parametrize("ptype", ["float", "double", "long double", "const float"])
def test_float_scalar_param_is_refused(ptype: str) -> None:
    with pytest.raises(InvalidCommand, match=r"'scale'.*floating-point"):
        parse_signature(f"void k(float *o, {ptype} scale) {{ }}", "k")


@pytest.mark.parametrize(
    ("src", "match"),
    [
        ("void k(float *o, mytype_t x) { }", "unsupported type"),
        ("void k(struct s x) { }", "unsupported type"),
        ("void k(int) { }", "no name"),
        ("void k(int n, ...) { }", "variadic"),
        ("void k(void (*cb)(int)) { }", "function pointer"),
        ("static void k(int *x) { }", "not exported"),
        ("static inline void k(int *x) { }", "not exported"),
        ("int k(int *x) { return 0; }", "must return void"),
        ("void *k(int *x) { return x; }", "must return void"),
    ],
)
def test_unsupported_signatures(src: str, match: str) -> None:
    with pytest.raises(InvalidCommand, match=match):
        parse_signature(src, "k")


def test_missing_entry() -> None:
    msg = (
        "entry 'add1' not found in the C source: it must hold a function definition "
        "'void add1(...)' (got none)"
    )
    for src in ("void add2(int *x) { }", "void add1(int *x);", "// void add1(int *x) { }"):
        with pytest.raises(InvalidCommand) as info:
            parse_signature(src, "add1")
        assert str(info.value) == msg


def test_pointer_after_int_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the compiler must not run for a bad signature")

    monkeypatch.setattr(subprocess, "run", no_run)
    with pytest.raises(InvalidCommand, match=r"'b'.*after integer value 'n'"):
        compile_c("void k(float *a, int n, float *b) { }", "k", cache_dir=tmp_path)
    p, v = (
        CParam(name="p", pointer=True, ctype=ctypes.c_void_p),
        CParam(name="v", pointer=False, ctype=ctypes.c_int),
    )
    with pytest.raises(InvalidCommand):
        CKernel(name="k", params=(v, p), fn=None, path="", address=0)


def test_compile_error_shows_compiler_message(tmp_path: Path) -> None:
    src = "void add1(float *out, int n) { out[0] = undefined_thing; }"
    with pytest.raises(InvalidCommand) as info:
        compile_c(src, "add1", cache_dir=tmp_path)
    msg = str(info.value)
    assert msg.startswith("C compile of 'add1' failed:\n")
    assert "undefined_thing" in msg and len(msg) < 4200
    assert not list(tmp_path.iterdir())  # no temporary files left behind


def test_compile_error_is_trimmed(tmp_path: Path) -> None:
    body = "".join(f"  undefined_thing_{i} = 1;\n" for i in range(300))
    src = "void k(int *x) {\n" + body + "}\n"
    with pytest.raises(InvalidCommand, match="more characters") as info:
        compile_c(src, "k", cache_dir=tmp_path)
    assert len(str(info.value)) < 4200


def test_missing_symbol_after_compile(tmp_path: Path) -> None:
    src = "#if 0\nvoid add1(float *o) { }\n#endif\nvoid other(void) { }\n"
    with pytest.raises(InvalidCommand, match="symbol 'add1' not found"):
        compile_c(src, "add1", cache_dir=tmp_path)


def test_a_call_to_an_undefined_function_is_refused_and_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It compiles (an implicit or extern declaration) but the loader refuses it: an
    InvalidCommand carrying the loader's message, and nothing left in the cache -- a
    second try compiles again and says the same, and so does a device's program()."""
    import trio

    import hcqa

    src = "void hcqa_nowhere(int n);\nvoid k(float *out, int n) { hcqa_nowhere(n); }\n"
    for _ in range(2):
        with pytest.raises(InvalidCommand, match="undefined symbol: hcqa_nowhere") as info:
            compile_c(src, "k", cache_dir=tmp_path)
        assert "'k' compiled but could not be loaded" in str(info.value)
        assert not list(tmp_path.iterdir())  # evicted (and no temporary files)

    async def program() -> None:
        async with hcqa.open_device("cpu:0") as d:
            with pytest.raises(InvalidCommand, match="undefined symbol: hcqa_nowhere"):
                d.program("k", src)

    monkeypatch.setenv("HCQA_CACHE_DIR", str(tmp_path))
    trio.run(program)
    # the device caches its own helpers there (the launch trampoline, the generic runner),
    # each loadable; the refused kernel is not among them
    for cached in tmp_path.iterdir():
        ctypes.CDLL(str(cached))


def test_no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidCommand, match="not found"):
        compile_c(ADD1, "add1", cache_dir=tmp_path, cc="/nonexistent/hcqa-cc")
    monkeypatch.setenv("CC", "hcqa-no-such-compiler")
    with pytest.raises(InvalidCommand, match="hcqa-no-such-compiler"):
        compile_c(ADD1, "add1", cache_dir=tmp_path)
    monkeypatch.delenv("CC")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(InvalidCommand, match="no C compiler found"):
        compile_c(ADD1, "add1", cache_dir=tmp_path)


def test_cache_hit_does_not_recompile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = compile_c(ADD1, "add1", cache_dir=tmp_path)
    mtime = os.stat(first.path).st_mtime_ns
    calls: list[object] = []

    def counting_run(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise AssertionError("a cache hit must not run the compiler")

    monkeypatch.setattr(subprocess, "run", counting_run)
    again = compile_c(ADD1, "add1", cache_dir=tmp_path)
    assert calls == []
    assert again.path == first.path and os.stat(again.path).st_mtime_ns == mtime
    assert again.address == first.address  # the library was loaded once
    assert [p.name for p in tmp_path.iterdir()] == [Path(first.path).name]
    # flags and source are part of the key: a change means a new library
    monkeypatch.undo()
    other = compile_c(ADD1, "add1", cache_dir=tmp_path, flags=("-O0",))
    assert other.path != first.path
    other = compile_c(ADD1 + "\n", "add1", cache_dir=tmp_path)
    assert other.path != first.path


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HCQA_CACHE_DIR", str(tmp_path / "env-cache"))
    k = compile_c(ADD1, "add1")
    assert Path(k.path).parent == tmp_path / "env-cache"


def test_concurrent_compiles_of_one_source(tmp_path: Path) -> None:
    src = ADD1.replace("1.0f", "2.0f")
    results: list[CKernel] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(compile_c(src, "add1", cache_dir=tmp_path))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len({k.path for k in results}) == 1
    a = np.arange(8, dtype=np.float32)
    out = np.zeros_like(a)
    results[0].fn(out.ctypes.data, a.ctypes.data, 8)
    np.testing.assert_array_equal(out, a + 2)
    assert [p.suffix for p in tmp_path.iterdir()] == [".so"]


def test_call_releases_the_gil(tmp_path: Path) -> None:
    spin = compile_c(SPIN, "spin", cache_dir=tmp_path)
    assert (spin.n_buffers, spin.n_vals) == (0, 1)

    def count_while(alive: Any) -> float:
        n, start = 0, time.perf_counter()
        while alive():
            n += 1
        return n / (time.perf_counter() - start)

    deadline = time.perf_counter() + 0.2
    baseline = count_while(lambda: time.perf_counter() < deadline)
    t = threading.Thread(target=spin.fn, args=(200,))
    start = time.perf_counter()
    t.start()
    during = count_while(t.is_alive)
    t.join()
    assert time.perf_counter() - start >= 0.19  # the kernel really ran ~200 ms
    # Holding the GIL for 200 ms would stop this thread; released, it counts at full speed.
    assert during > 0.05 * baseline, (during, baseline)
