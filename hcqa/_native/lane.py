"""The native lane's library: compiled once with the system C compiler, loaded with ctypes.

Theory of operation
-------------------
The C source (``lane_c.py``) holds three things that run without Python:

* ``hcqa_signal_store(slot, value, fd)``: how native code completes a signal -- the
  value word first, then the signal's eventfd when a waiter of this process is listed
  with a target the value reaches (the slot's *wake word*, see
  ``ParkingLot._rearm``) or the process has forked;
* a timeline (``hcqa_tl_*``): steps completed in any order, the timeline signal showing
  the completed prefix, HCQ's wrap into epochs of 2**31, and the count of foreign
  steps, under one mutex, so that C lanes and Python engines complete steps of one
  device on one structure;
* a lane (``hcqa_lane_*``): a ring of 40-byte records and one pthread that runs them
  in order -- a call ``fn(a, b)`` (a C kernel's trampoline, or a fused run), a
  ``memmove``, a signal store, a timestamp, a timeline step -- and hands over to the
  Python engine at ``PY`` records (it sleeps on a condition variable until the Python
  engine says that run is done). Every wait is a condition variable: nothing spins.

:func:`library` compiles and loads it on first use (the kernel cache makes that a
file lookup after the first time); ``None`` when there is no C compiler, or when
``HCQA_NATIVE_LANE=0``: then everything runs in Python as before. Calls that block
release the GIL (``CDLL``); the short ones keep it (``PYFUNCTYPE`` prototypes).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from typing import Any

from hcqa._native.lane_c import LANE_C

__all__ = [
    "OP_CALL", "OP_COPY", "OP_NOP", "OP_PY", "OP_SIGNAL", "OP_STAMP", "OP_STEP",
    "REC", "Native", "defer", "library", "register", "sweep", "unregister",
]  # fmt: skip

OP_NOP, OP_CALL, OP_COPY, OP_SIGNAL, OP_STAMP, OP_STEP, OP_PY = range(7)
REC = struct.Struct("<qqqqq")  # one record: op, a, b, c, d

_lock = threading.Lock()
_native: Native | None = None
_tried = False

_P = ctypes.c_void_p
_U64 = ctypes.c_uint64
_I64 = ctypes.c_int64
_INT = ctypes.c_int


class Native:
    """The loaded library's entry points."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

        def held(name: str, restype: Any, *argtypes: Any) -> Any:
            address = ctypes.cast(lib[name], _P).value or 0
            return ctypes.PYFUNCTYPE(restype, *argtypes)(address)

        def released(name: str, restype: Any, *argtypes: Any) -> Any:
            fn = lib[name]
            fn.restype = restype
            fn.argtypes = list(argtypes)
            return fn

        if held("hcqa_rec_size", _INT)() != REC.size:
            raise RuntimeError("native lane: record size mismatch")
        self.note_fork = held("hcqa_note_fork", None)
        self.full_fence = held("hcqa_full_fence", None)
        self.tl_new = held("hcqa_tl_new", _P, _U64, _P, _INT, _P, _INT, _P, _INT)
        self.tl_free = held("hcqa_tl_free", None, _P)
        self.tl_done = held("hcqa_tl_done", _U64, _P)
        self.tl_complete = held("hcqa_tl_complete", _INT, _P, _U64, _INT)
        self.lane_new = held("hcqa_lane_new", _P)
        self.lane_done_addr = held("hcqa_lane_done_addr", _P, _P)
        self.lane_tail_addr = held("hcqa_lane_tail_addr", _P, _P)
        self.lane_py_last_addr = held("hcqa_lane_py_last_addr", _P, _P)
        self.lane_start = held("hcqa_lane_start", _INT, _P)
        self.lane_push = held("hcqa_lane_push", _INT, _P, ctypes.c_char_p, _I64, _P)
        self.lane_try_turn = held("hcqa_lane_try_turn", _INT, _P, _I64)
        self.lane_py_done = held("hcqa_lane_py_done", None, _P, _I64)
        self.lane_fail = held("hcqa_lane_fail", None, _P)
        self.lane_tail = held("hcqa_lane_tail", _U64, _P)
        # these may sleep: the GIL is released
        self.lane_wait_turn = released("hcqa_lane_wait_turn", _INT, _P, _I64)
        self.lane_finish = released("hcqa_lane_finish", _U64, _P)
        self.lane_free = released("hcqa_lane_free", None, _P)


def library() -> Native | None:
    """The native lane library, compiled and loaded once per process (None if unavailable)."""
    global _native, _tried
    if _tried:
        return _native
    with _lock:
        if _tried:
            return _native
        try:
            if os.environ.get("HCQA_NATIVE_LANE", "1") != "0":
                _native = _build()
        finally:
            _tried = True
    return _native


def _build() -> Native | None:
    from hcqa._native.compiler import _load, compile_c
    from hcqa.errors import InvalidCommand

    try:
        kernel = compile_c(LANE_C, "hcqa_lane_abi", flags=("-O2", "-pthread"))
    except InvalidCommand:
        return None  # no C compiler: the Python engines do everything
    return Native(_load(kernel.path))


# -- releasing signal slots that queued records may still write -----------------------------
#
# A record holds a signal's slot address and eventfd. A signal that lanes were handed
# (``Signal._lanes``) and is closed meanwhile releases them only once each of those lanes
# has run past what it had queued at the close (``defer``); the lanes ``sweep`` at every
# push and when they finish.

_lanes: dict[int, Any] = {}  # lane address -> its engine (``tail()``, ``done()``)
_graves: list[tuple[Any, list[tuple[int, int]]]] = []


def register(address: int, engine: Any) -> None:
    with _lock:
        _lanes[address] = engine


def unregister(address: int) -> None:
    with _lock:
        _lanes.pop(address, None)
    sweep()


def defer(release: Any, lanes: set[int]) -> bool:
    """Call ``release()`` once each of ``lanes`` that is still live has run what it holds
    now; False (and do nothing) when none is live: release at once."""
    with _lock:
        marks = [(a, _lanes[a].tail()) for a in lanes if a in _lanes]
        if not marks:
            return False
        _graves.append((release, marks))
    return True


def sweep() -> None:
    """Release what no lane can write any more."""
    if not _graves:
        return
    ready = []
    with _lock:
        keep = []
        for release, marks in _graves:
            left = [(a, t) for a, t in marks if a in _lanes and _lanes[a].done() < t]
            if left:
                keep.append((release, left))
            else:
                ready.append(release)
        _graves[:] = keep
    for release in ready:
        release()


def _before_fork() -> None:
    if _native is not None:
        _native.note_fork()


os.register_at_fork(before=_before_fork)
