"""A lifted model kept on disk, so a second load skips the front end.

Theory of operation
-------------------
Capturing an ONNX file through tinygrad takes seconds to minutes (its codegen runs in Python;
only its compiler output is cached by tinygrad), while building the lifted kernels again is
quick (hcqa's C cache and PoCL's kernel cache hold the binaries). So :func:`load` /
:func:`store` keep the :class:`~hcqa.models.lifted.Lifted` record itself, keyed by a SHA-256 of
the model file's bytes, the front end and its version, hcqa's reader (the source of the modules
that read it), the device kind and the example shapes: a changed file, another tinygrad, a
changed reader or another batch size is another key.

The file is ``<key>.lifted`` in hcqa's private kernel cache (``$HCQA_CACHE_DIR``, default
``~/.cache/hcqa/kernels``, mode 0700, refused unless it is this user's), written to a temporary
name and renamed into place, and read only when it is a regular file of this user nobody else
can write (the kernels it names are compiled and run). Its format is plain data, never pickle:
``HCQALIFT1\\n``, an 8-byte little-endian header length, a JSON header (every field of the
record; a weight's bytes as an offset and length into the blob), then the blob. Anything
unreadable is a miss: the model is captured again and the entry rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from hcqa._native.compiler import _private_dir, _trusted
from hcqa.models.lifted import Arg, Base, Kernel, Lifted, Sym, TensorSpec

__all__ = ["key_for", "load", "store"]

MAGIC = b"HCQALIFT1\n"


def _root() -> Path:
    root = os.environ.get("HCQA_CACHE_DIR") or "~/.cache/hcqa/kernels"
    return _private_dir(Path(root).expanduser())


@functools.cache
def reader_digest() -> str:
    """A digest of the modules that read a front end and define the record (their source
    files, read without importing tinygrad): part of every key."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in ("_tinygrad.py", "lifted.py", "cache.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def key_for(*parts: object, file: Path) -> str:
    """The cache key of a model file's capture under ``parts`` (front end, version, shapes)."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    h.update(json.dumps([repr(p) for p in parts]).encode())
    return h.hexdigest()


def _sym_out(s: Sym) -> Any:
    return s if isinstance(s, (int, str)) else [s[0], _sym_out(s[1]), _sym_out(s[2])]


def _sym_in(s: Any) -> Sym:
    if isinstance(s, bool) or not isinstance(s, (int, str, list)):
        raise ValueError(f"bad symbol {s!r}")
    if isinstance(s, list):
        op, a, b = s
        if op not in ("+", "-", "*", "//"):
            raise ValueError(f"bad operator {op!r}")
        return (op, _sym_in(a), _sym_in(b))
    return s


def _arg_out(a: Arg) -> Any:
    return [a.base, a.offset, a.nbytes, a.dtype.str]


def _arg_in(a: Any) -> Arg:
    return Arg(base=int(a[0]), offset=int(a[1]), nbytes=int(a[2]), dtype=np.dtype(a[3]))


def _spec_out(s: TensorSpec) -> Any:
    return [s.name, list(s.shape), s.dtype.str]


def _spec_in(s: Any) -> TensorSpec:
    return TensorSpec(str(s[0]), tuple(s[1]), np.dtype(s[2]))


def store(key: str, lifted: Lifted) -> None:
    """Write ``lifted`` under ``key`` (best effort: a full disk only costs the next load)."""
    blob: list[bytes] = []
    at = 0
    bases = []
    for b in lifted.bases:
        ref = None
        if b.data is not None:
            ref = [at, len(b.data)]
            blob.append(b.data)
            at += len(b.data)
        bases.append([b.nbytes, b.role, b.slot, ref])
    kernels = [
        {
            "name": k.name, "entry": k.entry, "source": k.source,
            "args": [_arg_out(a) for a in k.args], "vals": [_sym_out(v) for v in k.vals],
            "writes": list(k.writes), "reads": list(k.reads),
            "global_size": [_sym_out(g) for g in k.global_size],
            "local_size": [_sym_out(x) for x in k.local_size],
            "core_id": k.core_id, "launches": k.launches, "ops": k.ops, "mem": k.mem,
        }
        for k in lifted.kernels
    ]  # fmt: skip
    header = json.dumps(
        {
            "language": lifted.language,
            "flags": list(lifted.flags),
            "bases": bases,
            "kernels": kernels,
            "inputs": [[_spec_out(s), _arg_out(a)] for s, a in lifted.inputs],
            "outputs": [[_spec_out(s), _arg_out(a)] for s, a in lifted.outputs],
            "variables": [list(v) for v in lifted.variables],
        }
    ).encode()
    try:
        root = _root()
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                for chunk in blob:
                    f.write(chunk)
            os.replace(tmp, root / f"{key}.lifted")
        finally:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
    except Exception:
        return


def load(key: str) -> Lifted | None:
    """The record stored under ``key``, or None (missing, not provably ours, or unreadable)."""
    try:
        path = _root() / f"{key}.lifted"
        if not _trusted(path):
            return None
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            return None
        (n,) = struct.unpack_from("<Q", data, len(MAGIC))
        start = len(MAGIC) + 8
        h = json.loads(data[start : start + n])
        blob = memoryview(data)[start + n :]
        bases = []
        for nbytes, role, slot, ref in h["bases"]:
            raw = None
            if ref is not None:
                off, length = int(ref[0]), int(ref[1])
                if off + length > len(blob) or length != int(nbytes):
                    return None
                raw = bytes(blob[off : off + length])
            bases.append(Base(nbytes=int(nbytes), role=role, slot=slot, data=raw))
        kernels = tuple(
            Kernel(
                name=str(k["name"]), entry=str(k["entry"]), source=str(k["source"]),
                args=tuple(_arg_in(a) for a in k["args"]),
                vals=tuple(_sym_in(v) for v in k["vals"]),
                writes=tuple(int(i) for i in k["writes"]),
                reads=tuple(int(i) for i in k["reads"]),
                global_size=tuple(_sym_in(g) for g in k["global_size"]),
                local_size=tuple(_sym_in(x) for x in k["local_size"]),
                core_id=None if k["core_id"] is None else int(k["core_id"]),
                launches=int(k["launches"]),
                ops=int(k.get("ops", 0)), mem=int(k.get("mem", 0)),
            )
            for k in h["kernels"]
        )  # fmt: skip
        for k in kernels:
            for a in k.args:
                if not 0 <= a.base < len(bases) or a.offset + a.nbytes > bases[a.base].nbytes:
                    return None
        return Lifted(
            language=h["language"],
            flags=tuple(str(f) for f in h["flags"]),
            bases=tuple(bases),
            kernels=kernels,
            inputs=tuple((_spec_in(s), _arg_in(a)) for s, a in h["inputs"]),
            outputs=tuple((_spec_in(s), _arg_in(a)) for s, a in h["outputs"]),
            variables=tuple((str(n), int(lo), int(hi)) for n, lo, hi in h["variables"]),
        )
    except Exception:
        return None
