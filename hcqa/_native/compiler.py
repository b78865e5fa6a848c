"""Compile C kernels with the system compiler and load them with ctypes.

Theory of operation
-------------------
``compile_c(source, entry)`` first parses the *definition* of ``entry`` out of the source
(comments, preprocessor lines and ``__attribute__((...))`` removed) to learn its parameters:
buffer pointers first, then integer values, each mapped to a ctypes type. Floating-point
scalars are refused, since a kernel's values are integers.

The shared library is cached on disk under ``<key>.so``, where the key is the SHA-256 of the
compiler's path and ``--version`` line, every flag and the source. A hit touches no compiler
(the version line is looked up once per compiler per process). A miss compiles into a temporary
file in the cache directory and ``os.replace``-s it into place, so concurrent threads and
processes that race on one key each publish a complete library and never see a partial one.
A library the loader refuses (a call to a function defined nowhere: "undefined symbol") is
rebuilt once; refused again, it is removed from the cache and the error is InvalidCommand.

The cache holds code this process will run, so it must be private: the directory is
made 0700 and refused unless this user owns it (one of ours left open to others is
tightened to 0700); a cached library is loaded only if it is a regular file of this user
that nobody else can write -- anything else is compiled again over it.

A library is loaded once per process (``ctypes.CDLL``, kept by path); each ``CKernel`` gets its
own function pointer. ``CDLL`` calls release the GIL: a worker thread's kernel won't block trio.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import attrs

from hcqa.errors import InvalidCommand

__all__ = ["CKernel", "CParam", "compile_c", "parse_signature"]

_LOCK = threading.Lock()
_VERSIONS: dict[tuple[str, ...], str] = {}  # compiler command -> first line of --version
_LIBS: dict[str, ctypes.CDLL] = {}  # loaded shared libraries, by path
_STDERR_LIMIT = 4000

_QUALIFIERS = frozenset(
    {"const", "volatile", "restrict", "__restrict", "__restrict__", "register", "_Atomic"}
)
_BASIC = frozenset({"signed", "unsigned", "short", "long", "int", "char"})
_FLOATS = frozenset({"float", "double", "_Float16", "__fp16", "__bf16", "_Complex"})
_TYPEDEFS: dict[str, type] = {
    "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "int16_t": ctypes.c_int16,
    "uint16_t": ctypes.c_uint16, "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32,
    "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t,
    "ssize_t": ctypes.c_ssize_t, "ptrdiff_t": ctypes.c_ssize_t, "intptr_t": ctypes.c_ssize_t,
    "uintptr_t": ctypes.c_size_t, "_Bool": ctypes.c_bool, "bool": ctypes.c_bool,
}  # fmt: skip
_KEYWORDS = _QUALIFIERS | _BASIC | _FLOATS | _TYPEDEFS.keys() | {"void", "struct", "union", "enum"}


@attrs.frozen(kw_only=True)
class CParam:
    """One parameter of a C kernel: a buffer pointer or an integer value."""

    name: str
    pointer: bool
    ctype: type


@attrs.frozen(kw_only=True)
class CKernel:
    """A compiled, loaded C kernel: ``fn(*buffer_addresses, *int_vals)``."""

    name: str
    params: tuple[CParam, ...]
    fn: Any = attrs.field(eq=False, repr=False)
    path: str
    address: int

    def __attrs_post_init__(self) -> None:
        _check_order(self.name, self.params)

    @property
    def n_buffers(self) -> int:
        return sum(p.pointer for p in self.params)

    @property
    def n_vals(self) -> int:
        return len(self.params) - self.n_buffers


def _check_order(entry: str, params: tuple[CParam, ...]) -> None:
    seen_val: CParam | None = None
    for p in params:
        if not p.pointer:
            seen_val = seen_val or p
        elif seen_val is not None:
            raise InvalidCommand(
                f"kernel {entry!r} takes buffer pointer {p.name!r} after integer value "
                f"{seen_val.name!r}; buffer pointers must come first, then integer values"
            )


_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|(/\*.*?\*/|//[^\n]*)', re.DOTALL)


def _after_parens(text: str, i: int) -> int:
    """Just past the ``)`` that closes a ``(`` ending at ``i`` (or the end of ``text``)."""
    depth = 1
    while i < len(text) and depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return i


def _clean(source: str) -> str:
    """``source`` without comments, literals, preprocessor lines or ``__attribute__((...))``."""
    text = _TOKENS.sub(lambda m: " " if m.group(1) else '""', source.replace("\\\n", ""))
    text = re.sub(r"^[ \t]*#[^\n]*", "", text, flags=re.MULTILINE)
    out: list[str] = []
    pos = 0
    for m in re.finditer(r"\b__attribute__\s*\(", text):
        if m.start() < pos:
            continue
        out.append(text[pos : m.start()] + " ")
        pos = _after_parens(text, m.end())
    return "".join(out) + text[pos:]


def _scalar_ctype(entry: str, name: str, words: list[str]) -> type:
    found = [w for w in words if w in _FLOATS]
    if found:
        raise InvalidCommand(
            f"parameter {name!r} of {entry!r} is a floating-point scalar ({' '.join(words)}); "
            "only buffer pointers and integer values are supported"
        )
    if len(words) == 1 and words[0] in _TYPEDEFS:
        return _TYPEDEFS[words[0]]
    if not words or not set(words) <= _BASIC:
        raise InvalidCommand(
            f"parameter {name!r} of {entry!r} has unsupported type {' '.join(words)!r}; "
            "use a pointer or an integer type"
        )
    unsigned, longs = "unsigned" in words, words.count("long")
    if "char" in words:
        return ctypes.c_ubyte if unsigned else ctypes.c_byte
    if "short" in words:
        return ctypes.c_ushort if unsigned else ctypes.c_short
    if longs == 1:
        return ctypes.c_ulong if unsigned else ctypes.c_long
    if longs >= 2:
        return ctypes.c_ulonglong if unsigned else ctypes.c_longlong
    return ctypes.c_uint if unsigned else ctypes.c_int


def _parse_param(entry: str, index: int, text: str) -> CParam:
    if text == "...":
        raise InvalidCommand(f"kernel {entry!r} is variadic; variadic kernels are unsupported")
    tokens = re.findall(r"[A-Za-z_]\w*|\S", text)
    array = "[" in tokens
    head = tokens[: tokens.index("[")] if array else tokens
    idents = [t for t in head if re.match(r"[A-Za-z_]", t)]
    if not idents or idents[-1] in _KEYWORDS:
        raise InvalidCommand(f"parameter {index} of {entry!r} ({text!r}) has no name")
    name = idents[-1]
    if array or "*" in head:
        return CParam(name=name, pointer=True, ctype=ctypes.c_void_p)
    words = [w for w in idents[:-1] if w not in _QUALIFIERS]
    return CParam(name=name, pointer=False, ctype=_scalar_ctype(entry, name, words))


def parse_signature(source: str, entry: str) -> tuple[CParam, ...]:
    """The parameters of the exported definition ``void entry(...) { ... }`` in ``source``."""
    text = _clean(source)
    for m in re.finditer(rf"(?<![\w.]){re.escape(entry)}\s*\(", text):
        i = _after_parens(text, m.end())
        if not text[i:].lstrip().startswith("{"):
            continue  # a prototype or a call, not the definition
        start = max(text.rfind(c, 0, m.start()) for c in ";{}") + 1
        specifiers = re.findall(r"\w+|\S", text[start : m.start()])
        if "static" in specifiers or ("inline" in specifiers and "extern" not in specifiers):
            raise InvalidCommand(
                f"entry {entry!r} is declared {' '.join(specifiers)!r}, so it is not exported; "
                f"define it as 'void {entry}(...)'"
            )
        if specifiers.count("void") != 1 or not set(specifiers) <= {"void", "extern", "inline"}:
            raise InvalidCommand(
                f"entry {entry!r} must return void (got {' '.join(specifiers)!r}); "
                f"define it as 'void {entry}(...)'"
            )
        body = " ".join(text[m.end() : i - 1].split())
        if "(" in body:
            raise InvalidCommand(f"kernel {entry!r} takes a function pointer; unsupported")
        if body in ("", "void"):
            return ()
        return tuple(_parse_param(entry, n, p.strip()) for n, p in enumerate(body.split(",")))
    raise InvalidCommand(
        f"entry {entry!r} not found in the C source: it must hold a function definition "
        f"'void {entry}(...)' (got none)"
    )


def _find_compiler(cc: str | None) -> tuple[str, ...]:
    spec = cc if cc is not None else os.environ.get("CC") or None
    if spec is not None:
        parts = shlex.split(spec)
        exe = shutil.which(parts[0]) if parts else None
        if exe is None:
            raise InvalidCommand(f"C compiler {spec!r} not found")
        return (exe, *parts[1:])
    for name in ("cc", "gcc", "clang"):
        if (exe := shutil.which(name)) is not None:
            return (exe,)
    raise InvalidCommand("no C compiler found: pass cc=..., set $CC, or install cc, gcc or clang")


def _compiler_id(cmd: tuple[str, ...]) -> str:
    with _LOCK:
        version = _VERSIONS.get(cmd)
    if version is None:
        try:
            r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            raise InvalidCommand(f"C compiler {cmd[0]!r} could not run: {exc}") from exc
        lines = (r.stdout or r.stderr).splitlines()
        version = lines[0].strip() if lines else f"exit status {r.returncode}"
        with _LOCK:
            _VERSIONS[cmd] = version
    return version


def _private_dir(root: Path) -> Path:
    """The cache directory, made (0700) if missing; refused unless it is a directory owned
    by this user that nobody else can write (a library another user could plant there
    would run inside this process). One we own but left open to others is tightened to
    0700 first."""
    uid = os.getuid()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = root.stat()
    except OSError as exc:
        raise InvalidCommand(
            f"C kernel cache {str(root)!r} can't be used: {exc.strerror}"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidCommand(f"C kernel cache {str(root)!r} must be a directory (got a file)")
    if st.st_uid != uid:
        raise InvalidCommand(
            f"C kernel cache {str(root)!r} must be owned by you (uid {uid}), since its "
            f"libraries run in this process (got a directory of uid {st.st_uid}); set "
            "HCQA_CACHE_DIR to a private directory"
        )
    if st.st_mode & 0o077:
        try:
            os.chmod(root, 0o700)
        except OSError as exc:
            raise InvalidCommand(
                f"C kernel cache {str(root)!r} must be private (mode 0700; got "
                f"{stat.S_IMODE(st.st_mode):04o}, and chmod failed: {exc.strerror})"
            ) from None
    return root


def _trusted(so: Path) -> bool:
    """True when the cached library ``so`` is a regular file (not a symlink) of this user
    that nobody else can write: only then may it be loaded."""
    try:
        st = os.lstat(so)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(cmd: tuple[str, ...], flags: Sequence[str], source: str, entry: str, so: Path) -> None:
    fd, src = tempfile.mkstemp(dir=so.parent, prefix=f".{so.stem}-", suffix=".c")
    out = src[:-2] + ".so.tmp"
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source)
        try:
            r = subprocess.run(
                [*cmd, *flags, "-o", out, src], capture_output=True, text=True, timeout=600
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise InvalidCommand(f"C compile of {entry!r} failed: {exc}") from exc
        if r.returncode != 0:
            msg = (r.stderr or r.stdout).replace(src, f"{entry}.c").strip()
            msg = msg or f"{cmd[0]} exited with status {r.returncode}"
            if len(msg) > _STDERR_LIMIT:
                msg = msg[:_STDERR_LIMIT] + f"\n... ({len(msg) - _STDERR_LIMIT} more characters)"
            raise InvalidCommand(f"C compile of {entry!r} failed:\n{msg}")
        os.chmod(out, 0o700)  # whatever the umask: nobody else may rewrite it
        os.replace(out, so)
    finally:
        for leftover in (src, out):
            with suppress(FileNotFoundError):
                os.unlink(leftover)


def _load(path: str) -> ctypes.CDLL:
    with _LOCK:
        lib = _LIBS.get(path)
        if lib is None:
            lib = _LIBS[path] = ctypes.CDLL(path)
        return lib


def compile_c(
    source: str,
    entry: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cc: str | None = None,
    flags: Sequence[str] = ("-O2",),
) -> CKernel:
    """Compile ``source`` (or reuse the cached library) and return its kernel ``entry``."""
    params = parse_signature(source, entry)
    _check_order(entry, params)
    cmd = _find_compiler(cc)
    all_flags = ("-std=c11", "-shared", "-fPIC", *flags)
    key_text = json.dumps([list(cmd), _compiler_id(cmd), list(all_flags), source])
    key = hashlib.sha256(key_text.encode()).hexdigest()
    root = cache_dir or os.environ.get("HCQA_CACHE_DIR") or "~/.cache/hcqa/kernels"
    so = _private_dir(Path(root).expanduser()) / f"{key}.so"
    if not _trusted(so):  # missing, or not provably ours: build (replacing it)
        _build(cmd, all_flags, source, entry, so)
    try:
        lib = _load(str(so))
    except OSError:  # a damaged cache entry: build it again, once
        _build(cmd, all_flags, source, entry, so)
        try:
            lib = _load(str(so))
        except OSError as exc:  # a fresh build the loader refuses (an undefined symbol)
            with suppress(FileNotFoundError):
                os.unlink(so)  # never cached: the next call compiles again
            why = str(exc).replace(str(so), f"{entry}.so")
            raise InvalidCommand(
                f"C kernel {entry!r} compiled but could not be loaded: {why} (a function "
                "it calls must be defined in its source or in a library this process has "
                "loaded)"
            ) from None
    try:
        fn = lib[entry]
    except AttributeError as exc:
        raise InvalidCommand(
            f"symbol {entry!r} not found in {so} after compiling; is its definition "
            "inside an #if, or is it hidden?"
        ) from exc
    fn.argtypes = [p.ctype for p in params]
    fn.restype = None
    address = ctypes.cast(fn, ctypes.c_void_p).value or 0
    return CKernel(name=entry, params=params, fn=fn, path=str(so), address=address)
