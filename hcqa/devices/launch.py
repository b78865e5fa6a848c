"""The launch record: a program's last eager call, checked once, reused by its repeats.

Theory of operation
-------------------
``prog(out, a)`` called again with the same buffers (the same objects), equal int vals and
the same geometry skips the checks that can't change between calls and reuses the checked
``Exec``'s fields and C argument tuple (:class:`_Launch`, kept on the :class:`Program` by
``program.py``). A C kernel's repeat calls are also timed where they run: after
``INLINE_AFTER`` short calls in a row the next ones may run inline on the caller's thread
(``Device._inline``), keeping the GIL (``_held_call``).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from hcqa import commands as cmd

__all__ = ["INLINE_AFTER", "SHORT_CALL_NS"]

# A C kernel's repeat call runs inline on the caller's thread (an idle queue, no hazard)
# once INLINE_AFTER calls in a row each took at most SHORT_CALL_NS: less than the two
# thread wake-ups the engine would cost, and well within what the event loop may be held.
SHORT_CALL_NS = 20_000
SLEEP_LIMIT_NS = 1_000_000
INLINE_AFTER = 3


class _Launch:
    """A program's launch record: the last eager call's arguments, already checked.

    A call with the same buffers (the same objects), equal int vals and the same
    geometry skips the checks that can't change between calls (types, devices, counts,
    ranges, geometry) and reuses the C argument tuple; only the buffers' freed / closed
    state is checked again. The record holds its buffers weakly (a program never keeps
    memory alive) and matches only immutable inputs: tuples of plain ints, never a list
    the caller could change."""

    __slots__ = (
        "access", "args", "buffers", "caller", "global_in", "global_size", "held",
        "local_in", "local_size", "native", "penalty", "ready", "short", "vals",
    )  # fmt: skip

    def __init__(self, exec_: cmd.Exec, global_in: object, local_in: object) -> None:
        self.buffers = tuple(weakref.ref(b) for b in exec_.buffers)
        self.vals: tuple[int, ...] = exec_.vals  # type: ignore[assignment]  # ints (see of)
        self.global_in, self.local_in = global_in, local_in
        self.global_size, self.local_size = exec_.global_size, exec_.local_size
        self.args = exec_.args
        # (written, read) buffer positions (the program's, for this many buffers)
        self.access = exec_.program.access(len(exec_.buffers))
        # A C kernel's repeat calls are timed (see ``_timed_call``): ``short`` counts the
        # calls in a row that took at most SHORT_CALL_NS; -1 once an inline call did not.
        self.ready = exec_.call
        self.short = 0
        self.penalty = 1
        self.held: Callable[[], object] | None = None  # ready, but keeping the GIL
        # What an executor cached on a repeat call's Exec (``Exec.native``: a native
        # lane's record of this very call, which holds no buffer): the next ones carry it.
        self.native: Any = None
        self.caller = threading.get_ident()  # the thread that runs inline calls

    @classmethod
    def of(
        cls, exec_: cmd.Exec, vals: object, global_size: object, local_size: object
    ) -> _Launch | None:
        """A record of this call, when it can be matched safely (else None)."""
        if not all(type(v) is int for v in exec_.vals):
            return None  # symbolic: resolved per submit
        for given in (global_size, local_size):
            if type(given) is not tuple or not all(type(d) is int for d in given):
                return None  # a list could change in place; Variables resolve per submit
        return cls(exec_, global_size, local_size)

    def matches(
        self, bufs: tuple[object, ...], vals: object, global_size: object, local_size: object
    ) -> bool:
        if global_size is not self.global_in or local_size is not self.local_in:
            return False
        refs = self.buffers
        if len(bufs) != len(refs):
            return False
        for b, ref in zip(bufs, refs, strict=True):
            if ref() is not b:
                return False
        mine = self.vals
        if vals is mine:
            return True
        if (type(vals) is not tuple and type(vals) is not list) or len(vals) != len(mine):
            return False
        return all(type(v) is int and v == w for v, w in zip(vals, mine, strict=True))

    def exec_for(self, program: cmd.ProgramRef, bufs: tuple[cmd.BufferRef, ...]) -> cmd.Exec:
        """The Exec of a repeat call: the checked one's fields, with its ready call timed
        (``_timed_call``, a C kernel's; None for a Python kernel, as ``Exec`` derives it)
        and what the executor cached on an earlier repeat (``native``)."""
        return _exec(
            program,
            bufs,
            self.vals,
            self.global_size,
            self.local_size,
            self.args,
            None if self.ready is None else self._timed_call,
            self.short >= INLINE_AFTER,
            self.native,
        )

    def _timed_call(self) -> None:
        """The kernel's call, timed on whichever thread runs it. INLINE_AFTER short calls
        in a row let the next ones run inline. Inline (on the caller's thread) the kernel
        is called with the GIL held: the caller waits for it anyway, and letting the GIL
        go would hand it to another thread for longer than the kernel takes. A long call
        starts the count again; one that ran inline also sets the count back by twice as
        many calls as the last time (a kernel whose time depends on its data)."""
        assert self.ready is not None
        if self.short >= INLINE_AFTER and threading.get_ident() == self.caller:
            held = self.held
            if held is None:
                held = self.held = _held_call(self.ready)
            t0 = time.perf_counter_ns()
            held()
            if time.perf_counter_ns() - t0 > SHORT_CALL_NS:
                self.penalty *= 2
                self.short = -self.penalty
            return
        t0 = time.perf_counter_ns()
        self.ready()
        if time.perf_counter_ns() - t0 <= SHORT_CALL_NS:
            self.short += 1
        elif self.short > 0:
            self.short = 0


# (program, buffers, vals, global_size, local_size, args, call, inline, native)
_exec = cmd.maker(cmd.Exec)


def _held_call(ready: Callable[[], object]) -> Callable[[], object]:
    """``ready`` (a partial of a C kernel over its arguments) as a call that keeps the
    GIL: the same function, through a ``PYFUNCTYPE`` prototype of the same signature."""
    assert isinstance(ready, functools.partial)
    fn: Any = ready.func
    proto = ctypes.PYFUNCTYPE(fn.restype, *fn.argtypes)
    address = ctypes.cast(fn, ctypes.c_void_p).value or 0
    return functools.partial(proto(address), *ready.args)
