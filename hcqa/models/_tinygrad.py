"""The one module that imports tinygrad: run a function under TinyJit and read what it captured.

Theory of operation
-------------------
tinygrad's jit internals change with every minor release (0.13 replaced its runners outright),
so hcqa reads exactly one version, :data:`PINNED`, checked when this module is imported: any
other is refused with an :class:`InvalidCommand` naming both.

:func:`capture` runs ``fn`` twice under ``TinyJit`` on the tinygrad device that matches the hcqa
device, with ``JIT=2`` (no tinygrad graph batches: plain kernel calls). In 0.14 the capture is
``jit.captured.linear``, a ``LINEAR`` UOp whose sources are ``CALL`` UOps; each call's first
source is a ``PROGRAM`` (its ``ProgramInfo`` has the name, geometry, Variables, which arguments
are buffers and which it writes; its source text is ``src[2].arg``), the rest are its arguments:
``PARAM`` s for the jit's inputs (by slot), ``BUFFER`` s, or views into a memory-planner arena
(``BITCAST`` on the CPU device), all resolved with ``UOp.buffer`` to a base ``Buffer`` and an
offset. A captured step that is not a program (a cross-device copy) is refused.

Every base that is not an input gets its bytes read back once (weights and state such as a KV
cache, which the graph reads before or without writing); a base only ever reached through
arena views is scratch. Variables become names; symbolic launch sizes become ``(op, a, b)``
trees over ``+ - * //`` (C division and ``%`` agree with floor division on the non-negative
ranges hcqa allows Variables; ``%`` is rewritten as ``a - a // b * b``). Everything leaves this
module as the plain records of :mod:`hcqa.models.lifted`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from hcqa.errors import InvalidCommand, install_hint
from hcqa.models import _toolchain
from hcqa.models.lifted import Arg, Base, Kernel, Lifted, Sym, TensorSpec

PINNED = "0.14.0"


def _check_version() -> None:
    try:
        found = importlib.metadata.version("tinygrad")
    except importlib.metadata.PackageNotFoundError:
        raise InvalidCommand(
            f"hcqa.models needs tinygrad {PINNED}: {install_hint('models')} (got no "
            "tinygrad installed)"
        ) from None
    if found != PINNED:
        raise InvalidCommand(
            f"hcqa.models reads tinygrad's internals and supports tinygrad {PINNED} only "
            f"(got tinygrad {found}): pip install 'tinygrad=={PINNED}'"
        )


_check_version()
_toolchain.apply_pocl_defaults()
_toolchain.ensure_opencl(required=False)  # before tinygrad probes its devices

from tinygrad import Context, Tensor, TinyJit  # noqa: E402
from tinygrad import Variable as TgVariable  # noqa: E402
from tinygrad import helpers as tg_helpers  # noqa: E402
from tinygrad.engine.realize import estimate_uop, get_call_arg_uops, get_call_var_uops  # noqa: E402
from tinygrad.uop.ops import Ops  # noqa: E402

__all__ = [
    "PINNED",
    "capture",
    "check_onnx_ops",
    "locked_capture",
    "locked_onnx_capture",
    "prepare",
    "release",
]

# tinygrad's CPU device compiles ``-O2 -fPIC -ffreestanding -fno-math-errno -nostdlib`` plus
# its -march; the same flags give the same code (hcqa adds -O2 and -fPIC itself; -nostdlib
# and the bare-metal target only shape an object file, not the code in it)
C_FLAGS = ("-ffreestanding", "-fno-math-errno", "-march=native")
_BINARY = {Ops.ADD: "+", Ops.MUL: "*", Ops.CDIV: "//"}


def prepare(kind: str) -> str:
    """Set up the machine for tinygrad's device of ``kind`` and return its name."""
    if kind == "opencl":
        _toolchain.ensure_opencl()
        return "CL"
    _settle_cc()
    return "CPU"


def _settle_cc() -> None:
    """Make tinygrad compile with hcqa's C compiler from now on, whatever touches its CPU
    device first (an ONNX runner's constants, a user's weights put there through
    ``models.tinygrad_device``: the device compiles helper programs when it opens).

    tinygrad reads ``$CC`` once (its ``getenv`` is cached) and keeps it: read it here, with
    ``$CC`` set to :func:`_toolchain.find_cc` (refused by name when there is no compiler at
    all). Where tinygrad already cached a compiler that is not on this machine (it was read
    before hcqa, and the machine's only clang is the zig wrapper), the cache is cleared and
    read again: every other setting reads the same environment again."""
    with _toolchain.clang_env() as cc:
        seen = tg_helpers.getenv("CC", "clang")
        if seen != cc and shutil.which(seen) is None:
            tg_helpers.getenv.cache_clear()
            tg_helpers.getenv("CC", "clang")


def _np_dtype(dtype: Any, where: str) -> np.dtype[Any]:
    fmt = getattr(dtype, "fmt", None)
    if not isinstance(fmt, str) or not fmt:
        raise InvalidCommand(f"{where}: tinygrad dtype {dtype} has no numpy equivalent")
    return np.dtype(fmt)


def _sym(u: Any, names: Mapping[str, tuple[int, int]], where: str) -> Sym:
    if isinstance(u, bool):
        raise InvalidCommand(f"{where}: a bool where a size was expected (got {u})")
    if isinstance(u, int):
        return u
    if isinstance(u, float):
        if not u.is_integer():
            raise InvalidCommand(f"{where}: a non-integer launch size (got {u})")
        return int(u)
    if u.op is Ops.CONST:
        return int(u.arg)
    if u.op is Ops.PARAM or getattr(u, "is_bound_var", False):
        name = u.expr
        if name not in names:
            raise InvalidCommand(
                f"{where}: tinygrad Variable {name!r} is not one of the model's variables "
                f"(got variables {sorted(names)})"
            )
        return str(name)
    if u.op in _BINARY:
        return (_BINARY[u.op], _sym(u.src[0], names, where), _sym(u.src[1], names, where))
    if u.op is Ops.CMOD:
        a, b = _sym(u.src[0], names, where), _sym(u.src[1], names, where)
        return ("-", a, ("*", ("//", a, b), b))
    raise InvalidCommand(
        f"{where}: symbolic size {u.op.name} can't become an hcqa expression (+ - * // only)"
    )


def _bound(x: Any) -> int:
    """An estimate as an int: a symbolic one (over Variables) at its upper bound."""
    if isinstance(x, int):
        return max(x, 0)
    try:
        return max(int(x.vmax), 0)
    except Exception:
        return 0


class _Reader:
    """Reads one captured jit into a :class:`Lifted`."""

    def __init__(self, names: Mapping[str, tuple[int, int]], inputs: Sequence[np.ndarray]):
        self.names = names
        self.inputs = inputs
        self.ids: dict[int, int] = {}  # id(tinygrad base Buffer) -> base index
        self.tg: list[Any] = []  # base index -> tinygrad Buffer (None for inputs)
        self.views_only: list[bool] = []
        self.written: set[int] = set()
        self.input_base: dict[int, int] = {}

    def _input(self, slot: int, where: str) -> int:
        if not 0 <= slot < len(self.inputs):
            raise InvalidCommand(f"{where}: jit input slot {slot} is not an example input")
        if slot not in self.input_base:
            self.input_base[slot] = len(self.tg)
            self.tg.append(None)
            self.views_only.append(False)
        return self.input_base[slot]

    def arg(self, u: Any, where: str) -> Arg:
        if u.op is Ops.PARAM:
            slot = int(u.arg.slot)
            a = self.inputs[slot] if 0 <= slot < len(self.inputs) else None
            index = self._input(slot, where)
            assert a is not None
            return Arg(base=index, offset=0, nbytes=a.nbytes, dtype=a.dtype)
        buf = u.buffer
        base = buf._base if buf._base is not None else buf
        found = self.ids.get(id(base))
        if found is None:
            index = self.ids[id(base)] = len(self.tg)
            self.tg.append(base)
            self.views_only.append(True)
        else:
            index = found
        if buf._base is None:
            self.views_only[index] = False
        offset = int(buf.offset) if buf._base is not None else 0
        return Arg(
            base=index, offset=offset, nbytes=int(buf.nbytes), dtype=_np_dtype(buf.dtype, where)
        )

    def kernel(self, n: int, call: Any, language: str) -> Kernel:
        prg = call.src[0]
        if prg.op is not Ops.PROGRAM:
            raise InvalidCommand(
                f"captured step {n} is a {prg.op.name} ({prg.arg!r}), not a kernel: the "
                "function must run on one device (no tensor crossing devices inside it)"
            )
        info = prg.arg
        where = f"kernel {n} ({info.function_name})"
        uops = get_call_arg_uops(call)
        args = tuple(self.arg(uops[i], where) for i in info.globals)
        writes = tuple(i for i, g in enumerate(info.globals) if g in info.outs)
        reads = tuple(i for i in range(len(args)) if i not in writes or info.globals[i] in info.ins)
        for i in writes:
            self.written.add(args[i].base)
        core_id = info.runtimevars.get("core_id")
        vals: list[Sym] = []
        for i, v in enumerate(get_call_var_uops(call, prg)):
            vals.append(0 if i == core_id else _sym(v, self.names, where))
        gs = tuple(_sym(g, self.names, where) for g in info.global_size)
        ls = tuple(_sym(x, self.names, where) for x in (info.local_size or (1, 1, 1)))
        launches: int = 1
        if language == "c":  # tinygrad's CPU device calls a kernel once per core_id
            if core_id is not None:
                if not isinstance(gs[0], int):
                    raise InvalidCommand(f"{where}: a symbolic core count (got {gs[0]})")
                launches = gs[0]
            gs = ls = (1, 1, 1)
        est = estimate_uop(call)
        return Kernel(
            name=info.function_name,
            entry=info.function_name,
            source=prg.src[2].arg,
            args=args,
            vals=tuple(vals),
            writes=writes,
            reads=reads,
            global_size=gs,
            local_size=ls,
            core_id=core_id,
            launches=launches,
            ops=_bound(est.ops),
            mem=_bound(est.mem),
        )

    def bases(self) -> tuple[Base, ...]:
        out: list[Base] = []
        slot_of = {b: s for s, b in self.input_base.items()}
        for i, buf in enumerate(self.tg):
            if buf is None:
                slot = slot_of[i]
                out.append(Base(nbytes=self.inputs[slot].nbytes, role="input", slot=slot))
            elif self.views_only[i]:
                out.append(Base(nbytes=int(buf.nbytes), role="scratch"))
            else:
                data = bytes(buf.as_memoryview())
                role: Literal["state", "weight"] = "state" if i in self.written else "weight"
                out.append(Base(nbytes=int(buf.nbytes), role=role, data=data))
        return tuple(out)


def _tensors(ret: Any) -> list[Any]:
    if isinstance(ret, Tensor):
        return [ret]
    if isinstance(ret, (tuple, list)) and ret and all(isinstance(t, Tensor) for t in ret):
        return list(ret)
    raise InvalidCommand(
        f"the function must return a tinygrad Tensor or a tuple of them (got {type(ret).__name__})"
    )


def capture(
    fn: Callable[..., Any],
    inputs: Sequence[np.ndarray],
    *,
    kind: str,
    variables: Mapping[str, tuple[int, int]],
    names: Sequence[str],
    out_names: Sequence[str] = (),
) -> Lifted:
    """Run ``fn`` under TinyJit on the device of ``kind`` and read what it captured."""
    device = prepare(kind)
    language: Literal["c", "opencl"] = "opencl" if kind == "opencl" else "c"
    tvars = {n: TgVariable(n, lo, hi) for n, (lo, hi) in variables.items()}
    jit = TinyJit(fn)
    ret: Any = None
    with Context(DEV=device, JIT=2):  # prepare() settled tinygrad's compiler
        for step in range(2):
            xs = [Tensor(np.ascontiguousarray(a), device=device).realize() for a in inputs]
            kw = {
                n: v.bind(min(lo + step, hi))
                for (n, v), (lo, hi) in zip(tvars.items(), variables.values(), strict=True)
            }
            try:
                ret = jit(*xs, **kw)
                outs = _tensors(ret)
                for t in outs:
                    t.realize()
            except InvalidCommand:
                raise
            except Exception as exc:
                raise InvalidCommand(
                    f"tinygrad could not run the function on {device}: {type(exc).__name__}: {exc}"
                ) from exc
    captured = jit.captured
    if captured is None:
        raise InvalidCommand("tinygrad captured nothing: the function ran no kernel")
    reader = _Reader(variables, inputs)
    kernels = tuple(reader.kernel(n, call, language) for n, call in enumerate(captured.linear.src))
    specs_in: list[tuple[TensorSpec, Arg]] = []
    for slot, a in enumerate(inputs):
        base = reader._input(slot, f"input {slot}")
        specs_in.append(
            (
                TensorSpec(names[slot], a.shape, a.dtype),
                Arg(base=base, offset=0, nbytes=a.nbytes, dtype=a.dtype),
            )
        )
    specs_out: list[tuple[TensorSpec, Arg]] = []
    for k, t in enumerate(_tensors(captured.ret)):
        where = f"output {k}"
        if not all(isinstance(d, int) for d in t.shape):
            raise InvalidCommand(f"{where}: a symbolic shape (got {t.shape})")
        shape = tuple(int(d) for d in t.shape)
        dt = _np_dtype(t.dtype, where)
        try:
            arg = reader.arg(t.uop, where)
        except Exception as exc:
            raise InvalidCommand(f"{where}: not a buffer a kernel writes ({exc})") from None
        if reader.tg[arg.base] is None:
            raise InvalidCommand(f"{where}: the function returns its input unchanged")
        nbytes = math.prod(shape) * dt.itemsize
        specs_out.append(
            (
                TensorSpec(out_names[k] if k < len(out_names) else f"output_{k}", shape, dt),
                Arg(base=arg.base, offset=arg.offset, nbytes=nbytes, dtype=dt),
            )
        )
    bases = list(reader.bases())
    for _, arg in specs_out:
        b = bases[arg.base]
        if b.role == "scratch":
            bases[arg.base] = Base(nbytes=b.nbytes, role="output")
    return Lifted(
        language=language,
        flags=C_FLAGS if language == "c" else (),
        bases=tuple(bases),
        kernels=kernels,
        inputs=tuple(specs_in),
        outputs=tuple(specs_out),
        variables=tuple((n, lo, hi) for n, (lo, hi) in variables.items()),
    )


def check_onnx_ops(model: Any, path: str) -> None:
    """Refuse a model with an operator tinygrad's ONNX front end can't lower, naming it."""
    from tinygrad.nn.onnx import onnx_ops

    for n, node in enumerate(model.graph.node):
        if node.op_type not in onnx_ops:
            raise InvalidCommand(
                f"{path!r} node {n} ({node.name or 'unnamed'}): operator {node.op_type!r} "
                f"can't be lowered by tinygrad {PINNED}'s ONNX front end; try "
                "backend='onnxruntime' on a cpu device"
            )


def _onnx_capture(
    path: str, inputs: Sequence[np.ndarray], kind: str, nodes: Sequence[tuple[str, str]]
) -> Lifted:
    """``nodes``: each ONNX node's (name, op type), in the file's order (tinygrad's runner
    keeps that order): a node that tinygrad can't lower is refused by name."""
    from tinygrad.nn.onnx import OnnxRunner

    device = prepare(kind)
    with Context(DEV=device):
        try:
            runner = OnnxRunner(path).to(device)
        except Exception as exc:
            raise InvalidCommand(
                f"tinygrad can't read {path!r} as ONNX: {type(exc).__name__}: {exc}"
            ) from exc
        for v in runner.graph_values.values():
            if isinstance(v, Tensor):
                v.realize()
    ins, outs = list(runner.graph_inputs), list(runner.graph_outputs)
    # How far a run got: -1 while it reads its inputs, then how many nodes it has lowered
    # (the runner calls each node's operator once, in order, through ``_select_op``).
    done = [-1]
    select, parse = runner._select_op, runner._parse_input

    def counted(op: str, opset: Any) -> Any:
        impl = select(op, opset)

        def run(*args: Any, **kwargs: Any) -> Any:
            ret = impl(*args, **kwargs)
            done[0] += 1
            return ret

        return run

    def parsing(*args: Any) -> Any:
        done[0] = -1
        value = parse(*args)
        done[0] = 0
        return value

    runner._select_op, runner._parse_input = counted, parsing  # (instance attributes)

    def forward(*xs: Any) -> Any:
        done[0] = -1
        try:
            got = runner(dict(zip(ins, xs, strict=True)))
        except Exception as exc:
            raise InvalidCommand(_refusal(path, nodes, done[0], exc)) from exc
        res = tuple(got[o] for o in outs)
        return res[0] if len(res) == 1 else res

    return capture(forward, inputs, kind=kind, variables={}, names=ins, out_names=outs)


def _refusal(path: str, nodes: Sequence[tuple[str, str]], k: int, exc: Exception) -> str:
    """Why tinygrad's ONNX front end failed at node ``k`` (-1: reading the inputs)."""
    why = f"{type(exc).__name__}: {exc}"
    if not 0 <= k < len(nodes):
        return f"{path!r}: tinygrad's ONNX front end could not take the inputs ({why})"
    name, op = nodes[k]
    return (
        f"{path!r} node {k} ({name or 'unnamed'}): operator {op!r} can't be lowered by "
        f"tinygrad {PINNED}'s ONNX front end ({why}); try backend='onnxruntime' on a cpu device"
    )


_LOCK = threading.Lock()  # tinygrad is not thread-safe: one capture at a time per process


@contextlib.contextmanager
def _own_thread() -> Iterator[None]:
    """Hold the tinygrad lock, and give this (worker) thread tinygrad's disk-cache connection
    of its own: sqlite connections refuse other threads, and tinygrad keeps one per process,
    made by whichever thread used it first (the caller's, realizing weights). Restored after."""
    with _LOCK:
        saved = tg_helpers._db_connection
        tg_helpers._db_connection = None
        try:
            yield
        finally:
            mine = tg_helpers._db_connection
            tg_helpers._db_connection = saved
            if mine is not None and mine is not saved:
                with contextlib.suppress(Exception):
                    mine.close()


def locked_capture(
    fn: Callable[..., Any],
    inputs: Sequence[np.ndarray],
    *,
    kind: str,
    variables: Mapping[str, tuple[int, int]],
    names: Sequence[str],
) -> Lifted:
    """:func:`capture` under the process-wide tinygrad lock (it runs in a worker thread)."""
    with _own_thread():
        return capture(fn, inputs, kind=kind, variables=variables, names=names)


def locked_onnx_capture(
    path: str, inputs: Sequence[np.ndarray], *, kind: str, nodes: Sequence[tuple[str, str]]
) -> Lifted:
    """tinygrad's ONNX runner for ``path`` (weights realized first), captured for ``inputs``;
    ``nodes``: each ONNX node's (name, op type), to name one tinygrad can't lower."""
    with _own_thread():
        return _onnx_capture(path, inputs, kind, nodes)


def release() -> None:
    """End tinygrad's pool of compiler processes (spawned by a capture to lower and compile
    kernels in parallel): no process of a load outlives it. The next capture spawns it again."""
    from tinygrad.engine.worker import terminate_worker_pool

    with _LOCK:
        terminate_worker_pool()
