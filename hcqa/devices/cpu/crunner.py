"""Native runners: a run of C kernels executed by one call into prebuilt C.

Theory of operation
-------------------
Dispatching a kernel from Python costs about a microsecond (a ctypes call and
the engine's loop); for tiny kernels that is the whole cost. A graph replays
the same kernels with the same arguments again and again, so a run of
consecutive C kernels on one queue becomes one call of a small C function
built once per process::

    void hcqa_run_generic(void **fn, const int64_t *a) {
        for (; fn[0] != 0; fn += 3) ((tramp_t)fn[0])(fn[1], a + (intptr_t)fn[2]);
    }

where ``fn`` lists, per kernel, its *trampoline* (``hcqa_tramp``, one per parameter
shape, compiled once and cached like any kernel: it unpacks the table into the kernel's
C parameters), the kernel's address and where its arguments start in ``a``, the
argument table (buffer addresses, then int vals, each widened to 64 bits). One ctypes
call then runs the whole run with the GIL released, and the per-kernel cost is two
indirect C calls. Nothing is compiled per run: a run is made on the caller's task (a
graph capture's end, a queue's submit), where a compile would block the event loop, and
the generic runner and the trampolines were loaded with the programs (``program_async``).

The argument table is a numpy ``int64`` array. Kernels whose arguments are all fixed
are packed once. A kernel whose vals (or launch geometry, for ``geometry=True``
kernels) hold Variables is fused too: its table entries are *symbolic* -- listed with
the expression and the C range they must fit -- and ``RunC.bound`` fills them into a
fresh copy of the table (one numpy assignment per distinct expression), so a symbolic run
stays one native call. Buffer addresses are listed as well (``refs``), so a replay on other
buffers rebinds them the same way. ``RunC`` is the cpu backend's
:class:`~hcqa.devices.fusion.FusedRun`: a graph replay or a queue's submit asks for it
through that interface, and :class:`~hcqa.devices.cpu.CpuDevice` makes it
(``_fusable``, ``_fuse``: the fusion seam).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from hcqa._native.compiler import CKernel, compile_c
from hcqa.devices.buffer import Buffer
from hcqa.devices.fusion import FusedRun
from hcqa.devices.hostarrays import array_address
from hcqa.errors import InvalidCommand

__all__ = ["RunC", "build_runner", "entries", "generic_entry", "trampoline", "wrap64"]


def _c_int_type(ctype: type) -> str:
    bits = ctypes.sizeof(ctype) * 8
    if ctype is ctypes.c_bool:
        return "_Bool"
    signed = ctype(-1).value == -1
    return f"{'' if signed else 'u'}int{bits}_t"


_INT64 = 2**63


def wrap64(v: int) -> int:
    """``v`` (a C integer of up to 64 bits, signed or not) as the int64 the table holds."""
    return v - 2**64 if v >= _INT64 else v


@attrs.frozen(kw_only=True, eq=False)
class RunC(FusedRun):
    """A command: call ``entry(fns, args)`` once -- every fused kernel, in order.

    ``table`` is the argument table; ``syms`` lists its symbolic
    entries as (position, expression, lo, hi, what) and ``refs`` its buffer addresses as
    (position, buffer): ``bound`` fills the former into a copy of the table and may rebind
    the latter (the :class:`~hcqa.devices.fusion.FusedRun` interface)."""

    entry: Any = attrs.field(repr=False)
    fns: Any = attrs.field(repr=False)
    table: Any = attrs.field(repr=False)
    names: tuple[str, ...]
    syms: tuple[tuple[int, Any, int, int, str], ...] = attrs.field(default=(), repr=False)
    refs: tuple[tuple[int, Any], ...] = attrs.field(default=(), repr=False)
    # what the run reads before writing and what it writes (``fusion.access_of``; rebound)
    reads: tuple[Buffer, ...] = attrs.field(default=(), repr=False)
    writes: tuple[Buffer, ...] = attrs.field(default=(), repr=False)
    # per buffer: its positions in the table (for rebinding), shared by every copy
    refmap: dict[Any, Any] = attrs.field(default=None, repr=False)
    # the distinct expressions of ``syms``, in order, and per expression: (its table
    # positions, the range all of them fit, what they are), shared by every copy
    symbols: tuple[Any, ...] = attrs.field(default=(), init=False, repr=False)
    groups: tuple[tuple[Any, Any, int, int, str], ...] = attrs.field(
        default=(), init=False, repr=False
    )
    native: Any = attrs.field(default=None, init=False, repr=False)  # a native lane's record
    # per buffer: its positions in ``reads`` and in ``writes`` (made at the first rebinding,
    # shared by the copies over the same buffers)
    bufpos: Any = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.refmap is None:
            by: dict[Any, list[int]] = {}
            for pos, b in self.refs:
                by.setdefault(b, []).append(pos)
            # a single position as an int: numpy sets one item far faster than a fancy index
            refmap = {b: p[0] if len(p) == 1 else np.array(p, dtype=np.intp) for b, p in by.items()}
            object.__setattr__(self, "refmap", refmap)
        grouped: dict[Any, tuple[list[int], int, int, str]] = {}
        for pos, expr, lo, hi, what in self.syms:
            if expr in grouped:
                positions, glo, ghi, gwhat = grouped[expr]
                positions.append(pos)
                grouped[expr] = (positions, max(glo, lo), min(ghi, hi), gwhat)
            else:
                grouped[expr] = ([pos], lo, hi, what)
        groups = tuple(
            (expr, np.array(p, dtype=np.intp), lo, hi, what)
            for expr, (p, lo, hi, what) in grouped.items()
        )
        object.__setattr__(self, "symbols", tuple(grouped))
        object.__setattr__(self, "groups", groups)

    def buffers(self) -> tuple[Buffer, ...]:
        return tuple(b for _, b in self.refs)

    def access(self) -> tuple[tuple[Buffer, ...], tuple[Buffer, ...]]:
        return self.reads, self.writes

    def bound(
        self, values: Mapping[Any, int] | None, rebind: Mapping[Buffer, Buffer] | None
    ) -> RunC:
        """A fresh copy of the table with one numpy assignment per distinct expression
        (range-checked) and the rebound buffers' addresses."""
        table = self.table.copy()
        if values is not None:
            for expr, positions, lo, hi, what in self.groups:
                v = values[expr]
                if not lo <= v <= hi:
                    raise InvalidCommand(f"{what} must be in [{lo}, {hi}] (got {v} from {expr})")
                table[positions] = wrap64(v)
        if rebind:
            refmap = self.refmap
            at = self.bufpos if self.bufpos is not None else self._buffer_positions()
            access: tuple[list[Buffer], list[Buffer]] | None = None  # (reads, writes) rebound
            for old, new in rebind.items():
                positions = refmap.get(old)
                if positions is not None:
                    table[positions] = new.va_addr
                where = at.get(old)
                if where is not None:  # (the rest of the run's buffers stay: no pass over all)
                    if access is None:
                        access = list(self.reads), list(self.writes)
                    for listed, places in zip(access, where, strict=True):
                        for i in places:
                            listed[i] = new
            if access is not None:
                return self.with_table(table, tuple(access[0]), tuple(access[1]))
        return self.with_table(table)

    def _buffer_positions(self) -> dict[Any, tuple[list[int], list[int]]]:
        """Per buffer, its positions in ``reads`` and in ``writes`` (cached on the run)."""
        at: dict[Any, tuple[list[int], list[int]]] = {}
        for k, bufs in enumerate((self.reads, self.writes)):
            for i, b in enumerate(bufs):
                at.setdefault(b, ([], []))[k].append(i)
        object.__setattr__(self, "bufpos", at)
        return at

    def with_table(
        self,
        table: Any,
        reads: tuple[Buffer, ...] | None = None,
        writes: tuple[Buffer, ...] | None = None,
    ) -> RunC:
        """The same run over another argument table (of the same layout; on the buffers
        ``reads`` and ``writes`` when rebound). Built field by field: a replay makes one of
        these per rebinding or per new value, and attrs' ``__init__`` costs several
        microseconds more."""
        new = object.__new__(RunC)
        setattr_ = object.__setattr__
        setattr_(new, "entry", self.entry)
        setattr_(new, "fns", self.fns)
        setattr_(new, "table", table)
        setattr_(new, "names", self.names)
        setattr_(new, "syms", self.syms)
        setattr_(new, "refs", self.refs)
        setattr_(new, "reads", self.reads if reads is None else reads)
        setattr_(new, "writes", self.writes if writes is None else writes)
        setattr_(new, "refmap", self.refmap)
        setattr_(new, "symbols", self.symbols)
        setattr_(new, "groups", self.groups)
        setattr_(new, "native", None)
        setattr_(new, "bufpos", self.bufpos if reads is None and writes is None else None)
        return new

    def __call__(self) -> None:
        self.entry(self.fns, array_address(self.table))


_TRAMPOLINES: dict[tuple[str, ...], int] = {}


def trampoline(kernel: CKernel) -> int:
    """The address of ``void hcqa_tramp(void *fn, const int64_t *a)``, which calls ``fn``
    (a kernel of ``kernel``'s parameter shape) with the arguments in table ``a`` -- how a
    native lane calls a kernel. One per shape, compiled once and cached like any kernel."""
    types = tuple("void *" if p.pointer else _c_int_type(p.ctype) for p in kernel.params)
    address = _TRAMPOLINES.get(types)
    if address is None:
        args = ", ".join(
            f"(void *)(intptr_t)a[{i}]" if t == "void *" else f"({t})a[{i}]"
            for i, t in enumerate(types)
        )
        source = (
            "#include <stdint.h>\n"
            f"typedef void (*k_t)({', '.join(types) or 'void'});\n"
            "void hcqa_tramp(void *fn, const int64_t *a) {\n"
            f"    (void)a;\n    ((k_t)fn)({args});\n"
            "}\n"
        )
        address = _TRAMPOLINES[types] = compile_c(source, "hcqa_tramp").address
    return address


Entry = tuple[Any, int, int, str]  # (int or expression or Buffer, lo, hi, what)


def _table(
    calls: Sequence[tuple[CKernel, Sequence[Entry]]],
) -> tuple[list[int], list[tuple[int, Any, int, int, str]], list[tuple[int, Any]], list[int]]:
    """The argument table of ``calls`` (each call's entries in turn), its symbolic entries,
    its buffer addresses, and where each call's entries start."""
    table: list[int] = []
    syms: list[tuple[int, Any, int, int, str]] = []
    refs: list[tuple[int, Any]] = []
    starts: list[int] = []
    for kernel, entries in calls:
        starts.append(len(table))
        if len(entries) != len(kernel.params):
            raise ValueError(f"{len(kernel.params)} arguments expected (got {len(entries)})")
        for value, lo, hi, what in entries:
            if isinstance(value, Buffer):
                refs.append((len(table), value))
                table.append(value.va_addr)
            elif isinstance(value, int):
                table.append(wrap64(value))
            else:
                syms.append((len(table), value, lo, hi, what))
                table.append(0)
    return table, syms, refs, starts


def build_runner(
    calls: Sequence[tuple[CKernel, Sequence[Entry]]],
    names: Sequence[str],
    access: tuple[tuple[Buffer, ...], tuple[Buffer, ...]],
) -> RunC:
    """One RunC for ``calls``: (kernel, its arguments as table entries: a buffer, an int or
    an expression, with the range it must fit and what it is, for error messages);
    ``access``: what the run reads and writes (``fusion.access_of``).

    Compiles nothing for this run: the generic runner (built once per process) calls each
    kernel through its trampoline (see :func:`trampoline`)."""
    table, syms, refs, starts = _table(calls)
    packed = np.array(table or [0], dtype=np.int64)
    words: list[int | None] = []
    for (kernel, _), start in zip(calls, starts, strict=True):
        words += [trampoline(kernel), kernel.address, start]
    fns = (ctypes.c_void_p * (len(words) + 1))(*words, None)
    return RunC(
        entry=generic_entry(),
        fns=fns,
        table=packed,
        names=tuple(names),
        syms=tuple(syms),
        refs=tuple(refs),
        reads=access[0],
        writes=access[1],
    )


_GENERIC_SOURCE = """#include <stdint.h>
typedef void (*tramp_t)(void *, const int64_t *);
/* fn: (trampoline, kernel, where its arguments start in a) per call, then NULL */
void hcqa_run_generic(void **fn, const int64_t *a) {
    for (; fn[0] != 0; fn += 3) ((tramp_t)fn[0])(fn[1], a + (intptr_t)fn[2]);
}
"""


@functools.cache
def generic_entry() -> Any:
    """``hcqa_run_generic``, compiled (and cached on disk) once per process."""
    entry = compile_c(_GENERIC_SOURCE, "hcqa_run_generic").fn
    entry.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return entry


def entries(e: Any) -> list[Entry] | None:
    """A C Exec's arguments as table entries, or None when it can't be fused (a symbolic
    size for a kernel that does not receive its geometry: that is checked per replay)."""
    prog = e.program
    name = prog.name
    out: list[Entry] = [(b, 0, 0, name) for b in e.buffers]
    assert prog.val_ranges is not None
    for v, (pname, lo, hi) in zip(e.vals, prog.val_ranges, strict=True):
        out.append((v, lo, hi, f"{name!r} val {pname!r}"))
    sizes = (*e.global_size, *e.local_size)
    if prog.geometry:
        for v, (pname, lo, hi) in zip(sizes, prog._geometry_ranges, strict=True):
            out.append((v, max(lo, 1), hi, f"{name!r} geometry parameter {pname!r}"))
    elif not all(isinstance(v, int) for v in sizes):
        return None
    return out
