"""The peer: tinygrad 0.14's CPU device (HCQ-based), driven the way its users drive it.

Optional, never a test dependency. ``load()`` returns ``None`` with a reason when tinygrad
(``pip install tinygrad==0.14.0``, the version hcqa.models reads) or clang (its CPU device
shells out to it) is missing.

tinygrad 0.14 picks its device from ``DEV`` (``DEV=CPU``; ``CPU=1`` is refused as
deprecated), read at import: this module sets ``DEV=CPU`` unless the caller already did.

Everything here is synchronous: the peer blocks its caller, which is how it is used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import shutil
from collections.abc import Callable
from typing import Any

__all__ = ["Peer", "load"]

NOOP_SRC = "void noop(unsigned char *restrict data0) { (void)data0; }\n"


class Peer:
    """tinygrad's CPU device(s): a tiny program, cross-device copies, a TinyJit chain."""

    def __init__(self) -> None:
        Device = _tg().Device
        self.version = importlib.metadata.version("tinygrad")
        self.Device = Device
        self.dev0 = Device["CPU"]
        self.dev1 = Device["CPU:1"]
        lib = self.dev0.compiler.compile_cached(NOOP_SRC)
        # 0.14: a program is made from a TinyELF (object bytes, name, target, signature)
        elf = _module("tinygrad.device").TinyELF
        uint8 = _module("tinygrad.dtype").dtypes.uint8
        sig = (("data0", 0, uint8, ()),)  # only core_id is looked up in it on CPU
        target = self.dev0.renderer.target
        self._prg = self.dev0.runtime(elf(lib=lib, name="noop", target=target, signature=sig))
        self._buf = self.dev0.allocator.alloc(64)
        self.call_program()  # first call: queues, kernargs, signals

    # -- direct program call ------------------------------------------------------------

    def call_program(self) -> None:
        """One launch of a tiny compiled program (HCQProgram.__call__) + synchronize."""
        self._prg(self._buf)
        self.dev0.synchronize()

    # -- cross-device copy ----------------------------------------------------------------

    def copier(self, nbytes: int) -> Callable[[], None]:
        """An eager ``CPU:0 -> CPU:1`` copy of ``nbytes`` (``Tensor.to().realize()``) + sync."""
        tg = _tg()
        src = tg.Tensor.ones(nbytes, dtype=tg.dtypes.uint8, device="CPU:0").contiguous().realize()
        dev1 = self.dev1

        def copy() -> None:
            out = src.to("CPU:1").realize()
            dev1.synchronize()
            del out

        copy()
        return copy

    # -- JIT ------------------------------------------------------------------------------

    def jit_chain(self, n: int) -> tuple[Callable[[], None], int]:
        """A TinyJit function running ``n`` dependent tiny elementwise kernels (16 floats).

        ``(x + 1).contiguous()`` per step keeps the scheduler from fusing the chain into one
        kernel. Returns (replay + synchronize, kernels the captured JIT really runs)."""
        tg = _tg()

        def chain(x: Any) -> Any:
            for _ in range(n):
                x = (x + 1).contiguous()
            return x.realize()

        jit = tg.TinyJit(chain)
        x = tg.Tensor.zeros(16).contiguous().realize()
        dev0 = self.dev0
        for _ in range(3):  # run, capture, first replay
            jit(x)
            dev0.synchronize()
        kernels = _captured_kernels(jit)
        expect = float(n)
        got = jit(x).tolist()[0]
        if got != expect:
            raise RuntimeError(f"tinygrad JIT chain of {n} computed {got} (expected {expect})")

        def replay() -> None:
            jit(x)
            dev0.synchronize()

        return replay, kernels


def _module(name: str) -> Any:
    """Import a tinygrad module as ``Any``: it is untyped for our purposes (py.typed, but
    its exports are implicit)."""
    return importlib.import_module(name)


def _tg() -> Any:
    return _module("tinygrad")


def _captured_kernels(jit: Any) -> int:
    """How many kernels a captured TinyJit replays (graph batches counted per kernel)."""
    Ops = _module("tinygrad.uop.ops").Ops
    captured = jit.captured
    if captured is None:
        return 0
    n = 0
    for call in captured.linear.src:
        ast = call.src[0]
        if ast.op is Ops.CUSTOM_FUNCTION and ast.arg == "graph":
            n += len(ast.src[0].src)
        elif ast.op is Ops.PROGRAM:
            n += 1
    return n


def load() -> tuple[Peer | None, str]:
    """(the peer, "") or (None, why it is skipped)."""
    if importlib.util.find_spec("tinygrad") is None:
        return None, "peer: tinygrad not installed"
    version = importlib.metadata.version("tinygrad")
    if shutil.which("clang") is None:
        return None, f"peer: tinygrad {version} installed but clang is missing (apt install clang)"
    os.environ.setdefault("DEV", "CPU")
    try:
        return Peer(), ""
    except Exception as exc:  # an incompatible version or a broken toolchain: skip the peer
        return None, f"peer: tinygrad {version} unusable here ({type(exc).__name__}: {exc})"
