"""What tinygrad needs from the machine, set up by hcqa before tinygrad loads (no tinygrad here).

Theory of operation
-------------------
**A clang.** tinygrad's CPU device renders C that only clang accepts (``ext_vector_type``
vectors) and compiles it with ``$CC`` (default ``clang``, taken as one word, read once per
process). hcqa compiles the same source for ``cpu:N`` with the same compiler, through its own
C cache (which also reads ``$CC``). :func:`find_cc` picks, unless ``$CC`` is already set:
the system's ``clang``, else the ``ziglang`` wheel (installed by ``pip install -e '.[models]'``,
whose ``zig cc`` *is* clang) behind a small private wrapper script, which turns tinygrad's
bare-metal target triple (``--target=x86_64-none-unknown-elf``) into zig's spelling
(``-target x86_64-freestanding-none``) and turns off the debug info zig emits by default
(tinygrad's ELF loader refuses its absolute relocations). :func:`clang_env` sets ``$CC`` to it
only around tinygrad's capture (tinygrad reads ``$CC`` once, at its first compile, and keeps
it) and around hcqa's builds of tinygrad's C, then restores it: hcqa's other kernels keep the
process's compiler (the cache key names the compiler, so nothing is mixed up).

**pip's PoCL for tinygrad's CL device.** PyOpenCL's wheel carries its own ICD loader
(``pyopencl/.libs/libOpenCL-*.so*``), and PoCL's entry in it finds PoCL through
``$PYOPENCL_HOME``, which importing PyOpenCL sets. tinygrad's CL device loads ``$OPENCL_PATH``
by absolute path: :func:`ensure_opencl` imports PyOpenCL and points ``$OPENCL_PATH`` at the very
loader PyOpenCL loaded, so both drivers of the process (hcqa's and tinygrad's) are one loader and
one PoCL, set up with hcqa's ``POCL_MAX_PTHREAD_COUNT``. Measured: no ``$LD_LIBRARY_PATH`` is
needed once the loader is already in the process; without PyOpenCL imported first, the loader
finds no platform (-1001) or crashes. Both run before tinygrad is imported, since tinygrad may
probe its devices (and read ``$CC`` / ``$OPENCL_PATH``, once) before any model asks for one.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from hcqa.errors import InvalidCommand, install_hint

__all__ = ["apply_pocl_defaults", "clang_env", "ensure_opencl", "find_cc", "zig_wrapper"]

_WRAPPER = """#!/bin/sh
# Written by hcqa.models: zig's bundled clang as a C compiler for tinygrad's kernels.
# tinygrad asks for a bare-metal object with --target=<arch>-none-unknown-elf; zig spells
# that -target <arch>-freestanding-none. Every other argument goes through unchanged.
for a; do
  shift
  case "$a" in
    --target=*-none-unknown-elf)
      arch=${a#--target=}; arch=${arch%%-*}
      [ "$arch" = arm64 ] && arch=aarch64
      set -- "$@" -target "$arch-freestanding-none";;
    *) set -- "$@" "$a";;
  esac
done
# -g0 first: zig cc emits debug info by default, whose absolute relocations tinygrad's own ELF
# loader refuses (R_X86_64_32); a later -g still wins.
exec '@ZIG@' cc -g0 "$@"
"""


def _cache_root() -> Path:
    root = os.environ.get("HCQA_CACHE_DIR") or "~/.cache/hcqa/kernels"
    return Path(root).expanduser()


def zig_wrapper() -> str | None:
    """The path of the wrapper around the ``ziglang`` wheel's ``zig cc`` (written when missing
    or stale), or None without the wheel."""
    spec = importlib.util.find_spec("ziglang")
    if spec is None or spec.origin is None:
        return None
    zig = Path(spec.origin).parent / "zig"
    if not zig.is_file():
        return None
    root = _cache_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = root / "hcqa-zig-cc"
    text = _WRAPPER.replace("@ZIG@", str(zig).replace("'", "'\\''"))
    try:
        current = path.read_text() if path.is_file() else None
    except OSError:
        current = None
    if current != text or os.stat(path).st_uid != os.getuid():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        os.chmod(tmp, stat.S_IRWXU)
        os.replace(tmp, path)
    return str(path)


def find_cc() -> str:
    """The C compiler for tinygrad's kernels: ``$CC`` when the user set it, else ``clang``,
    else the zig wrapper; InvalidCommand when there is none."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return cc
    found = shutil.which("clang") or zig_wrapper()
    if found is None:
        raise InvalidCommand(
            "tinygrad's CPU kernels need clang: install hcqa's 'models' extra (it brings "
            "the ziglang wheel, whose 'zig cc' is a clang), install clang, or set $CC to one "
            "(got no clang on PATH and no ziglang package)"
        )
    return found


@contextlib.contextmanager
def clang_env() -> Iterator[str]:
    """``$CC`` set to :func:`find_cc` for the block (tinygrad's compiles, hcqa's builds of
    tinygrad's C), then restored: the rest of the process keeps its own compiler."""
    cc = find_cc()
    old = os.environ.get("CC")
    os.environ["CC"] = cc
    try:
        yield cc
    finally:
        if old is None:
            os.environ.pop("CC", None)
        else:
            os.environ["CC"] = old


def apply_pocl_defaults() -> None:
    """hcqa's ``POCL_MAX_PTHREAD_COUNT`` default, set before tinygrad could start PoCL."""
    if importlib.util.find_spec("pyopencl") is not None:
        from hcqa.devices.opencl import platforms

        platforms.apply_thread_defaults()


def ensure_opencl(required: bool = True) -> None:
    """Import PyOpenCL and point tinygrad's ``$OPENCL_PATH`` at the loader it loaded (nothing
    without PyOpenCL when not ``required``)."""
    if not required and importlib.util.find_spec("pyopencl") is None:
        return
    try:
        import pyopencl
    except ImportError as exc:
        raise InvalidCommand(
            f"tinygrad's CL device needs PyOpenCL: {install_hint('opencl')} (got {exc})"
        ) from None
    home = os.path.dirname(pyopencl.__file__)
    os.environ.setdefault("PYOPENCL_HOME", home)
    if not os.environ.get("OPENCL_PATH"):
        libs = sorted(glob.glob(os.path.join(home, ".libs", "libOpenCL*.so*")))
        if libs:
            os.environ["OPENCL_PATH"] = libs[0]
