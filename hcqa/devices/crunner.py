"""Native runners: a run of C kernels executed by one call into generated C.

Theory of operation
-------------------
Dispatching a kernel from Python costs about a microsecond (a ctypes call and
the engine's loop); for tiny kernels that is the whole cost. A graph replays
the same kernels with the same arguments again and again, so for a run of
consecutive C kernels on one queue it generates a small C function::

    void hcqa_run(void **fn, const int64_t *a) {
        ((sig0)fn[0])((void *)a[0], (void *)a[1], (int32_t)a[2]);
        ((sig1)fn[1])(...);
    }

where each ``sigN`` is a function-pointer type built from the kernel's
parameter list, ``fn`` holds the kernels' addresses and ``a`` their arguments
(buffer addresses, then int vals, each widened to 64 bits). The source depends
only on the *shapes* of the calls, so it is compiled once and cached like any
kernel; the tables are plain ctypes arrays. One ctypes call then runs the whole
run with the GIL released, and the per-kernel cost is an indirect C call.

Only kernels whose arguments are fixed are fused: their packed arguments
(``Exec.args``) go into ``a`` once. Kernels with variables stay ordinary Execs,
patched per replay like any other command.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import attrs

from hcqa.devices.compiler import CKernel, compile_c

__all__ = ["RunC", "build_runner", "fuse_static_runs"]


def _c_int_type(ctype: type) -> str:
    bits = ctypes.sizeof(ctype) * 8
    if ctype is ctypes.c_bool:
        return "_Bool"
    signed = ctype(-1).value == -1
    return f"{'' if signed else 'u'}int{bits}_t"


@attrs.frozen(kw_only=True, eq=False)
class RunC:
    """A command: call ``entry(fns, args)`` once -- every fused kernel, in order."""

    entry: Any = attrs.field(repr=False)
    fns: Any = attrs.field(repr=False)
    args: Any = attrs.field(repr=False)
    names: tuple[str, ...]

    def __call__(self) -> None:
        self.entry(self.fns, self.args)


def build_runner(calls: Sequence[tuple[CKernel, Sequence[int]]], names: Sequence[str]) -> RunC:
    """One RunC for ``calls``: (kernel, its packed arguments: buffer addresses, then vals)."""
    lines = ["#include <stdint.h>"]
    types: dict[tuple[str, ...], str] = {}
    body: list[str] = []
    table: list[int] = []
    for i, (kernel, call_args) in enumerate(calls):
        ctypes_ = tuple("void *" if p.pointer else _c_int_type(p.ctype) for p in kernel.params)
        if ctypes_ not in types:
            types[ctypes_] = f"sig{len(types)}"
            lines.append(f"typedef void (*{types[ctypes_]})({', '.join(ctypes_) or 'void'});")
        args = []
        for t, value in zip(ctypes_, call_args, strict=True):
            cast = "(void *)(intptr_t)" if t == "void *" else f"({t})"
            args.append(f"{cast}a[{len(table)}]")
            table.append(value)
        body.append(f"    (({types[ctypes_]})fn[{i}])({', '.join(args)});")
    lines.append("void hcqa_run(void **fn, const int64_t *a) {")
    lines.extend(body)
    lines.append("}")
    kernel = compile_c("\n".join(lines) + "\n", "hcqa_run")
    fns = (ctypes.c_void_p * len(calls))(*[k.address for k, _ in calls])
    packed = (ctypes.c_int64 * max(1, len(table)))(*[ctypes.c_int64(v).value for v in table])
    entry = kernel.fn
    entry.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return RunC(entry=entry, fns=fns, args=packed, names=tuple(names))


def fuse_static_runs(
    template: list[Any], patches: list[tuple[int, str, Any]]
) -> tuple[list[Any], list[tuple[int, str, Any]], int]:
    """Replace runs of >= 2 C Execs with fixed arguments on a device that allows it
    (``native_runner``) by one :class:`RunC`; the new template, the patch slots moved to
    their new positions, and how many runners were made."""
    from hcqa import commands as cmd

    patched = {i for i, _, _ in patches}
    out: list[Any] = []
    remap: dict[int, int] = {}
    run: list[Any] = []
    made = 0

    def flush() -> None:
        nonlocal made
        if len(run) >= 2 and getattr(run[0].program.device, "native_runner", False):
            calls = [(e.program.kernel, e.args) for e in run]
            out.append(build_runner(calls, [e.program.name for e in run]))
            made += 1
        else:
            out.extend(run)
        run.clear()

    for i, c in enumerate(template):
        # Exec.args is packed at validation exactly when the kernel is C and its vals fixed
        if i not in patched and isinstance(c, cmd.Exec) and c.args is not None:
            run.append(c)
            continue
        flush()
        remap[i] = len(out)
        out.append(c)
    flush()
    return out, [(remap[i], kind, data) for i, kind, data in patches], made
