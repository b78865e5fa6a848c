"""A Model: lifted kernels built on an hcqa device as one captured Graph, awaited with numpy.

Theory of operation
-------------------
:func:`build` turns a :class:`~hcqa.models.lifted.Lifted` into hcqa objects on one device:
each base is one allocation (weights and state get their bytes copied in once; scratch is only
allocated), each kernel argument a view of its base, each distinct (source, entry) one program
built with the front end's compiler flags. Then one :func:`hcqa.capture` block records the
whole call: copy-ins from host staging arrays, every launch (a kernel that counts ``core_id``
is launched once per core, with ``core_id`` as a val), copy-outs into host staging arrays. The
copies run on the compute queue where the device allows it (cpu, OpenCL): a replay is then one
batch of one queue, with no cross-queue Wait for the event loop to see through.
Variables become :class:`hcqa.Variable` s, symbolic launch sizes hcqa expressions over them.

A :class:`Model` holds one such build per batch size (its *buckets*; a single one when the
shapes are fixed). ``await model(x, start_pos=3)`` checks every array (ndarray, dtype, shape)
and every variable name before anything is queued (:class:`InvalidCommand` naming the input),
picks the smallest bucket that holds the batch, takes a free *slot* of it, copies the arrays
into the slot's staging arrays (padding rows zeroed), replays the slot's graph (one submit per
queue) and returns copies of its own rows of the outputs.

A bucket has ``depth`` slots (default 2): the same work captured ``depth`` times, each graph
with its own host staging arrays but all over the bucket's one set of device buffers. So up
to ``depth`` calls are in flight at once: call ``k + 1`` is copied in and queued while call
``k`` runs, and ``k``'s results are copied out while ``k + 1`` runs -- the device never waits
for the event loop between two calls. The device buffers being shared, the replays still run
one after another in the order they were submitted (the graphs' boundaries carry the same
buffer hazards as eager work), so a model with state sees the calls in that order, as with
one slot. Slots are handed out by a
:class:`hcqa._slots.SlotPool`, as pipelines' are: a call takes its place in the bucket's line
when it is made (in the caller's own task, trio or asyncio) and keeps it until it has
submitted, so calls reach the device in the order they were made -- neither two waiters woken
for free slots in one round nor two asyncio calls handed to the trio host together (trio runs
a round's tasks in either order) are swapped. A slot returns to the pool when its call is
answered; a cancelled caller's slot only once the replay it left queued has run.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from hcqa import aio
from hcqa._slots import SlotPool, Turn
from hcqa.devices import Buffer, Device, Program
from hcqa.errors import InvalidCommand
from hcqa.graph import Graph, capture
from hcqa.models import _toolchain
from hcqa.models.lifted import Arg, Kernel, Lifted, Sym, TensorSpec
from hcqa.signals import Fence
from hcqa.variables import IntLike, Variable

__all__ = [
    "Bucket", "Model", "ModelStatistics", "Slot", "build", "build_programs", "copy_in",
    "copy_out", "launch", "program_key",
]  # fmt: skip


@attrs.frozen
class ModelStatistics:
    """A snapshot of a model: what it holds and how often it ran."""

    name: str
    device: str
    batch_sizes: tuple[int, ...]
    kernels: int  # launches per call of the largest bucket
    programs: int
    weight_bytes: int  # copied once at load (weights and state), per bucket summed
    scratch_bytes: int
    calls: int
    rows_padded: int


@attrs.define(eq=False)
class Slot:
    """One call in flight on a bucket: a captured Graph and the host arrays it copies from and
    to (every slot of a bucket shares its device buffers)."""

    graph: Graph
    host_in: tuple[np.ndarray, ...]
    host_out: tuple[np.ndarray, ...]
    failure: str | None = None  # set by a kernel that refuses its input (onnxruntime's)


@attrs.define(eq=False)
class Bucket:
    """One batch size: its device buffers and ``len(slots)`` captured graphs over them."""

    slots: list[Slot]
    variables: dict[str, Variable]
    launches: int
    programs: int
    weight_bytes: int
    scratch_bytes: int
    buffers: list[Buffer]
    lifted: Lifted | None = None  # what it was built from (None: an opaque kernel)
    pool: SlotPool[Slot] = attrs.field(init=False)  # its slots, taken in call order

    def __attrs_post_init__(self) -> None:
        self.pool = SlotPool(len(self.slots))
        self.pool.fill(list(reversed(self.slots)))  # slot 0 is taken first

    @property
    def graph(self) -> Graph:
        """The first slot's Graph (every slot's records the same work)."""
        return self.slots[0].graph


def copy_in(buf: Buffer, host: np.ndarray) -> Fence:
    """``buf.copyin(host)`` on the compute queue where the device runs host copies there: a
    model's replay is then one queue's batch, queued right behind the one before it (see
    the module doc)."""
    return buf.device._copyin(buf, host, on_compute=True)


def copy_out(buf: Buffer, host: np.ndarray) -> Fence:
    """``buf.copyout(host)`` on the compute queue where the device allows it."""
    return buf.device._copyout(buf, host, on_compute=True)


def _expr(s: Sym, variables: dict[str, Variable]) -> IntLike:
    if isinstance(s, int):
        return s
    if isinstance(s, str):
        return variables[s]
    op, a, b = s
    x, y = _expr(a, variables), _expr(b, variables)
    if isinstance(x, int) and isinstance(y, int):
        return {"+": x + y, "-": x - y, "*": x * y, "//": x // y}[op]
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    if op == "*":
        return x * y
    return x // y


def _fixed(spec: TensorSpec) -> tuple[int, ...]:
    if any(d is None for d in spec.shape):
        raise InvalidCommand(f"{spec.name}: a lifted tensor needs a fixed shape (got {spec.shape})")
    return tuple(int(d) for d in spec.shape if d is not None)


ProgramKey = tuple[str, str, tuple[int, ...], tuple[int, ...]]


def program_key(k: Kernel) -> ProgramKey:
    """Kernels that share this share one program (names are not unique: keyed by source)."""
    return (k.source, k.entry, k.writes, k.reads)


async def build_programs(
    device: Device, lifted: Lifted, kernels: Sequence[Kernel]
) -> dict[ProgramKey, Program]:
    """One program on ``device`` per distinct kernel of ``kernels``, with the front end's flags
    (built off the event loop)."""
    programs: dict[ProgramKey, Program] = {}
    # tinygrad's C needs the clang it was rendered for: $CC set around these builds only
    compiler = _toolchain.clang_env() if lifted.language == "c" else contextlib.nullcontext()
    with compiler:
        for k in kernels:
            key = program_key(k)
            if key not in programs:
                programs[key] = await device.program_async(
                    k.name, k.source, entry=k.entry, writes=k.writes, reads=k.reads,
                    flags=lifted.flags,
                )  # fmt: skip
    return programs


def launch(k: Kernel, prog: Program, args: Sequence[Buffer], variables: dict[str, Variable]) -> int:
    """Enqueue ``k`` (once per core when it counts ``core_id``); returns the launches made."""
    gs = tuple(_expr(g, variables) for g in k.global_size)
    ls = tuple(_expr(x, variables) for x in k.local_size)
    vals = [_expr(v, variables) for v in k.vals]
    for core in range(k.launches):
        if k.core_id is not None:
            vals[k.core_id] = core
        prog(*args, vals=tuple(vals), global_size=gs, local_size=ls)
    return k.launches


async def build(
    device: Device, lifted: Lifted, weights: dict[bytes, Buffer] | None = None, *, depth: int = 2
) -> Bucket:
    """Allocate, copy weights, build programs and capture ``depth`` Graphs for ``lifted`` (the
    bucket's slots: each its own host staging arrays, all over the same device buffers).

    ``weights``: read-only weights already on ``device`` by a digest of their bytes (another
    bucket's); a weight found there is shared, not copied again, and new ones are added."""
    variables = {n: Variable(n, lo, hi) for n, lo, hi in lifted.variables}
    bufs: list[Buffer] = []
    weight_bytes = scratch_bytes = 0
    for base in lifted.bases:
        digest = b""
        if base.role == "weight" and base.data is not None and weights is not None:
            digest = hashlib.sha256(base.data).digest()
            if digest in weights:
                bufs.append(weights[digest])
                continue
        buf = device.alloc(base.nbytes)
        bufs.append(buf)
        if digest and weights is not None:
            weights[digest] = buf
        if base.data is not None:
            buf.copyin(np.frombuffer(base.data, np.uint8))
            weight_bytes += base.nbytes
        elif base.role == "scratch":
            scratch_bytes += base.nbytes
    views: dict[Arg, Buffer] = {}

    def view(arg: Arg) -> Buffer:
        got = views.get(arg)
        if got is None:
            base = bufs[arg.base]
            n = arg.nbytes // arg.dtype.itemsize
            got = views[arg] = base.view(arg.offset, arg.nbytes, dtype=arg.dtype, shape=(n,))
        return got

    programs = await build_programs(device, lifted, lifted.kernels)
    slots: list[Slot] = []
    launches = 0
    for _ in range(depth):
        host_in = tuple(np.zeros(_fixed(spec), spec.dtype) for spec, _ in lifted.inputs)
        host_out = tuple(np.zeros(_fixed(spec), spec.dtype) for spec, _ in lifted.outputs)
        launches = 0
        with capture() as graph:
            for (_, arg), host in zip(lifted.inputs, host_in, strict=True):
                copy_in(view(arg), host.reshape(-1))
            for k in lifted.kernels:
                args = [view(a) for a in k.args]
                launches += launch(k, programs[program_key(k)], args, variables)
            for (_, arg), host in zip(lifted.outputs, host_out, strict=True):
                copy_out(view(arg), host.reshape(-1))
        slots.append(Slot(graph, host_in, host_out))
    return Bucket(
        slots=slots,
        variables=variables,
        launches=launches,
        programs=len(programs),
        weight_bytes=weight_bytes,
        scratch_bytes=scratch_bytes,
        buffers=bufs,
        lifted=lifted,
    )


class Model:
    """A captured model on one hcqa device: ``await model(*arrays, **variables)``.

    ``backend``: what made its kernels -- ``"tinygrad"`` (its compiled kernels, from
    :func:`~hcqa.models.load_onnx` or :func:`~hcqa.models.from_tinygrad`) or
    ``"onnxruntime"`` (one session run as a Python kernel); ``hcqa.serve`` reports it as
    the model's platform."""

    def __init__(
        self,
        *,
        name: str,
        device: Device,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        buckets: dict[int, Bucket],
        batched: bool,
        backend: str = "tinygrad",
    ) -> None:
        self.name = name
        self.backend = backend
        self.device = device
        self.inputs = inputs
        self.outputs = outputs
        self._buckets = dict(sorted(buckets.items()))
        self.batch_sizes: tuple[int, ...] = tuple(self._buckets) if batched else ()
        self._batched = batched
        self._largest = self._buckets[max(self._buckets)]
        self.depth = min(len(b.slots) for b in self._buckets.values())  # calls in flight
        self._calls = 0
        self._padded = 0

    @property
    def graph(self) -> Graph:
        """The Graph of the largest (or only) bucket."""
        return self._largest.graph

    @property
    def variables(self) -> tuple[Variable, ...]:
        return tuple(self._largest.variables.values())

    def __repr__(self) -> str:
        ins = ", ".join(f"{s.name}{list(s.shape)}:{s.dtype}" for s in self.inputs)
        return f"<Model {self.name} on {self.device.name} ({ins})>"

    def _check(self, arrays: Sequence[Any], variables: dict[str, Any]) -> tuple[int, Bucket]:
        if len(arrays) != len(self.inputs):
            raise InvalidCommand(
                f"model {self.name!r} takes {len(self.inputs)} input(s) "
                f"({', '.join(s.name for s in self.inputs)}) (got {len(arrays)})"
            )
        rows: int | None = None
        for spec, a in zip(self.inputs, arrays, strict=True):
            where = f"model {self.name!r} input {spec.name!r}"
            if not isinstance(a, np.ndarray):
                raise InvalidCommand(f"{where} must be a numpy ndarray (got {type(a).__name__})")
            if a.dtype != spec.dtype:
                raise InvalidCommand(f"{where} must have dtype {spec.dtype} (got {a.dtype})")
            if a.ndim != len(spec.shape) or any(
                d is not None and d != n for d, n in zip(spec.shape, a.shape, strict=True)
            ):
                shown = ", ".join("N" if d is None else str(d) for d in spec.shape)
                shown += "," if len(spec.shape) == 1 else ""
                raise InvalidCommand(f"{where} must have shape ({shown}) (got {a.shape})")
            if self._batched:
                if rows is not None and a.shape[0] != rows:
                    raise InvalidCommand(
                        f"{where} must have the batch size of the first input, {rows} "
                        f"(got {a.shape[0]})"
                    )
                rows = a.shape[0]
        names = set(self._largest.variables)
        if set(variables) != names:
            raise InvalidCommand(
                f"model {self.name!r} takes variables {sorted(names)} (got {sorted(variables)})"
            )
        for n, v in variables.items():
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InvalidCommand(
                    f"model {self.name!r} variable {n!r} must be an int (got {type(v).__name__})"
                )
        if not self._batched:
            return 0, self._largest
        assert rows is not None
        for size, bucket in self._buckets.items():
            if rows <= size:
                if rows < 1:
                    break
                return rows, bucket
        raise InvalidCommand(
            f"model {self.name!r} batch size must be in [1, {max(self._buckets)}] (got {rows})"
        )

    async def __call__(self, *arrays: Any, **variables: int) -> Any:
        """Run the model on ``arrays``: one array out, or a tuple when it has several outputs."""
        rows, bucket = self._check(arrays, variables)
        turn = bucket.pool.join()  # its place in line: the call's order is made here
        try:
            if aio.asyncio_caller():
                return await aio.call(self._run, arrays, rows, bucket, variables, turn)
            return await self._run(arrays, rows, bucket, variables, turn)
        finally:
            turn.leave()

    async def _run(
        self, arrays: Any, rows: int, bucket: Bucket, variables: dict[str, int], turn: Turn
    ) -> Any:
        """One call, in the trio host: a slot once ``turn`` heads the line (at once, in this
        step, when it does and one is free); leaves the line once its replay is queued."""
        vals = {n: int(v) for n, v in variables.items()}
        with await bucket.pool.take(turn) as lease:
            slot = lease.slot
            for host, a in zip(slot.host_in, arrays, strict=True):
                if self._batched:
                    host[:rows] = a
                    host[rows:] = 0
                else:
                    host[...] = a
            slot.failure = None
            fence = lease.fence = slot.graph.submit(**vals)  # type: ignore[arg-type]
            lease.queued()
            await fence
            if slot.failure is not None:  # a Python kernel refused this input
                why, slot.failure = slot.failure, None
                raise InvalidCommand(f"model {self.name!r} could not run this input: {why}")
            outs = tuple((h[:rows] if self._batched else h).copy() for h in slot.host_out)
            self._calls += 1
            if self._batched:
                self._padded += slot.host_in[0].shape[0] - rows
        return outs[0] if len(outs) == 1 else outs

    def statistics(self) -> ModelStatistics:
        b = self._largest
        return ModelStatistics(
            name=self.name,
            device=self.device.name,
            batch_sizes=self.batch_sizes,
            kernels=b.launches,
            programs=b.programs,
            weight_bytes=sum(x.weight_bytes for x in self._buckets.values()),
            scratch_bytes=sum(x.scratch_bytes for x in self._buckets.values()),
            calls=self._calls,
            rows_padded=self._padded,
        )
