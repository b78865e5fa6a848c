"""Per-replay patching of a graph's templates: variables and rebound buffers.

Theory of operation
-------------------
A graph's template holds, per queue, the commands every replay sends unchanged, and
*slots* for what may change: a :class:`CommandSlot` (a command with variables) or a
:class:`RunSlot` (a fused run whose arguments have symbolic entries: the backend's
:class:`~hcqa.devices.fusion.FusedRun`, reached only through that interface).

A replay first resolves each distinct expression of the graph once (every Variable
range-checked once), giving ``values``. Each slot then asks only for the values of the
expressions it mentions: if they are the ones of its last build, the command it built
then is sent again (commands are immutable and a run's table is never written after it
is built, so a replay still in flight is unaffected); otherwise it builds anew -- a
command through the queue's resolver, a run through ``FusedRun.bound`` (the cpu backend:
a copy of its table with one numpy assignment per distinct expression). So a value that
did not change costs a tuple compare, and one that did costs a copy of the table, not a
rebuild of every command.

Rebinding (``g(buffers={captured: new})``): :func:`check_rebind` refuses a mapping that
does not fit before anything is sent; then every template entry that mentions a rebound
buffer -- a static command, a fused run's address entries, a slot -- is rebuilt for this
replay only (never cached: the next replay may bind other buffers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hcqa import commands as cmd
from hcqa.devices.buffer import Buffer
from hcqa.devices.fusion import FusedRun
from hcqa.errors import InvalidCommand
from hcqa.variables import Expr, IntLike, Variable, VarVals, resolve

__all__ = ["CommandSlot", "RunSlot", "buffers_of", "check_rebind", "rebind_command"]

Rebind = Mapping[Buffer, Buffer]
_SYM = (Variable, Expr)


def symbols_of(c: Any) -> tuple[IntLike, ...]:
    """The distinct symbolic ints a command mentions, in a fixed order."""
    out: dict[Any, None] = {}
    for value in attrs.astuple(c, recurse=False):
        items = value if isinstance(value, tuple) else (value,)
        for v in items:
            if isinstance(v, _SYM):
                out[v] = None
    return tuple(out)


def buffers_of(c: Any) -> tuple[Buffer, ...]:
    """The buffers a template entry mentions (for rebinding)."""
    t = type(c)
    if t is cmd.Exec:
        return tuple(c.buffers)
    if t is cmd.Copy:
        return tuple(b for b in (c.dest, c.src) if isinstance(b, Buffer))
    if t is cmd.Load:
        return (c.dest,)
    if isinstance(c, FusedRun):
        return c.buffers()
    return ()


def rebind_command(c: Any, rebind: Rebind) -> Any:
    """``c`` with the buffers in ``rebind`` replaced (addresses repacked)."""
    t = type(c)
    if t is cmd.Exec:
        bufs = tuple(rebind.get(b, b) for b in c.buffers)
        c.program.check_buffers(bufs)  # a view the kernel can't take: refused before sending
        args = c.program.c_args(bufs, c.vals, c.global_size, c.local_size)
        return attrs.evolve(c, buffers=bufs, args=args)
    if t is cmd.Copy:
        dest = rebind.get(c.dest, c.dest) if isinstance(c.dest, Buffer) else c.dest
        src = rebind.get(c.src, c.src) if isinstance(c.src, Buffer) else c.src
        return attrs.evolve(c, dest=dest, src=src)
    if t is cmd.Load:
        return attrs.evolve(c, dest=rebind.get(c.dest, c.dest))
    if isinstance(c, FusedRun):
        return c.bound(None, rebind)
    return c


class CommandSlot:
    """A command with variables, rebuilt only when the values it uses change.

    A Python kernel's Exec whose only variables are among its vals is *patched in
    place*: the template itself is sent, variables and all, and the replay's batch starts
    with a ``Bind`` of the replay's values, from which the engine resolves the vals when
    it runs the kernel (the values were range-checked once for the whole replay; a Python
    kernel's vals have no C range). Nothing is built per replay, and a replay still in
    flight keeps its own ``Bind``."""

    __slots__ = ("checks", "command", "key", "last", "patch", "symbols")

    def __init__(self, command: Any, *, in_place: bool = False) -> None:
        self.command = command
        self.symbols = symbols_of(command)
        self.key: tuple[int, ...] | None = None
        self.last: Any = None
        # per val: its position in ``symbols`` (or -1: a constant), for an Exec patched
        # in place (only where the batch gets a Bind: with ``in_place``), on a device whose
        # executor resolves vals from a Bind (``Device._patches_in_place``)
        self.patch: tuple[int, ...] | None = None
        # (symbol, lo, hi, parameter name) per typed val patched in place: checked per build
        self.checks: tuple[tuple[Any, int, int, str], ...] = ()
        if (
            in_place
            and type(command) is cmd.Exec
            and command.program.device._patches_in_place(command)
        ):
            sizes = (*command.global_size, *command.local_size)
            if not any(isinstance(v, _SYM) for v in sizes):
                index = {s: i for i, s in enumerate(self.symbols)}
                self.patch = tuple(index.get(v, -1) if isinstance(v, _SYM) else -1
                                   for v in command.vals)  # fmt: skip
                ranges = getattr(command.program, "val_ranges", None) or ()
                self.checks = tuple(
                    (v, lo, hi, name)
                    for v, (name, lo, hi) in zip(command.vals, ranges, strict=False)
                    if isinstance(v, _SYM)
                )

    def build(
        self, values: dict[Any, int], bound: Any, rebind: Rebind | None, in_place: bool = True
    ) -> Any:
        """The command to send for ``values`` (``in_place``: False to resolve even a command
        patched in place, for a batch without a Bind)."""
        if self.patch is not None and rebind is None and in_place:
            self.check(values)
            return self.command  # patched in place: its batch carries a Bind (see Bind)
        key = tuple([values[s] for s in self.symbols])
        if rebind is None and key == self.key:
            return self.last
        c = self.command if rebind is None else rebind_command(self.command, rebind)
        out = _resolve_command(c, bound, values)
        if rebind is None:
            self.key, self.last = key, out
        return out

    def check(self, values: dict[Any, int]) -> None:
        """Refuse values out of the C range of a typed val patched in place."""
        for v, lo, hi, name in self.checks:
            if not lo <= values[v] <= hi:
                prog = self.command.program.name
                raise InvalidCommand(
                    f"{prog!r} val {name!r} must be in [{lo}, {hi}] (got {values[v]})"
                )


class RunSlot:
    """A fused run with symbolic entries (``hcqa/devices/fusion.py``), bound anew only
    when the values it uses change: the backend's ``FusedRun.bound`` fills them (and any
    rebound buffers) into a fresh copy of its argument table."""

    patch = None  # never patched in place (see CommandSlot)
    checks = ()

    __slots__ = ("key", "last", "run", "symbols")

    def __init__(self, run: FusedRun) -> None:
        self.run = run
        self.symbols = run.symbols
        self.key: tuple[int, ...] | None = None
        self.last: FusedRun | None = None

    def build(self, values: dict[Any, int], bound: Any, rebind: Rebind | None) -> FusedRun:
        key = tuple([values[s] for s in self.symbols])
        if rebind is None and key == self.key:
            assert self.last is not None
            return self.last
        out = self.run.bound(values, rebind)
        if rebind is None:
            self.key, self.last = key, out
        return out


def resolve_all(symbols: tuple[IntLike, ...], bound: Any) -> dict[Any, int]:
    """Each distinct expression's value (each Variable bound and range-checked)."""
    return {s: resolve(s, bound) for s in symbols}


def _refuse_mismatch(old: Buffer, new: Buffer) -> None:
    for what, want, got in (
        ("device", old.device.name, new.device.name),
        ("nbytes", old.nbytes, new.nbytes),
        ("dtype", old.dtype, new.dtype),
        ("shape", old.shape, new.shape),
    ):
        if want != got:
            raise InvalidCommand(
                f"the buffer bound in place of {old!r} must have {what} {want} (got {got})"
            )
    raise InvalidCommand(  # two devices of one name: not possible while both are open
        f"the buffer bound in place of {old!r} must be on that very device (got {new!r})"
    )


def check_rebind(
    rebind: object,
    captured: Mapping[Buffer, int],
    shared: set[Buffer],
    allocations: set[int] | frozenset[int],
) -> dict[Buffer, Buffer]:
    """Refuse a ``buffers=`` mapping that does not fit, before anything is sent.

    ``captured``: every buffer the graph uses -> its allocation id; ``shared``: those whose
    allocation the graph also uses through another buffer (a view); ``allocations``: the
    allocation ids of all of them."""
    if type(rebind) is not dict and not isinstance(rebind, Mapping):
        raise InvalidCommand(
            f"'buffers' must be a dict {{captured: new}} (got {type(rebind).__name__})"
        )
    out: dict[Buffer, Buffer] = {}
    for old, new in rebind.items():
        for what, b in (("key", old), ("value", new)):
            if not isinstance(b, Buffer):
                raise InvalidCommand(
                    f"'buffers' {what}s must be hcqa.Buffers (got {type(b).__name__})"
                )
        if old not in captured:
            raise InvalidCommand(f"'buffers' key {old!r} must be a buffer this graph captured")
        if new is old:
            continue
        if old in shared:
            raise InvalidCommand(
                f"{old!r} can't be rebound: the graph also uses its memory through another "
                "buffer (a view or its base); capture with one buffer per allocation"
            )
        if not (
            new.device is old.device
            and new.nbytes == old.nbytes
            and new.dtype == old.dtype
            and new.shape == old.shape
        ):
            _refuse_mismatch(old, new)
        new._check()
        out[old] = new
    if out:
        gone = {captured[old] for old in out}
        seen: set[int] = set()
        for old, new in out.items():
            a = id(new._hazards)
            if a in seen or (a in allocations and a not in gone):
                raise InvalidCommand(
                    f"the buffer bound in place of {old!r} must not share memory with another "
                    f"buffer of this replay (got {new!r})"
                )
            seen.add(a)
    return out


# -- resolving one command (a queue submit and a graph replay both come here) ----------------


def _check_copy_size(nbytes: int, dest: Buffer, src: Buffer) -> None:
    limit = min(dest.nbytes, src.nbytes)
    if not 0 < nbytes <= limit:
        raise InvalidCommand(
            f"copy 'nbytes' must be in [1, {limit}] (dest has {dest.nbytes}, src has "
            f"{src.nbytes} bytes) (got {nbytes})"
        )


def _resolve_command(
    c: Any, var_vals: VarVals | None, values: Mapping[Any, int] | None = None
) -> Any:
    """``c`` with its symbolic ints resolved and checked. ``values``: the expressions'
    values when the caller resolved each once already (a graph replay), else they are
    resolved against ``var_vals`` here."""

    def get(v: IntLike) -> int:
        if isinstance(v, int):
            return v
        return values[v] if values is not None else resolve(v, var_vals)

    t = type(c)
    if t is cmd.Wait or t is cmd.Signal:
        if isinstance(c.value, int):
            return c
        v = get(c.value)
        if not 0 <= v < 2**64:
            raise InvalidCommand(f"'value' must be in [0, 2**64 - 1] (got {v} from {c.value})")
        return attrs.evolve(c, value=v)
    if t is cmd.Exec:
        prog = c.program
        vals = tuple([get(v) for v in c.vals])
        prog.check_vals(vals)
        sizes = [c.global_size, c.local_size]
        if not all([type(v) is int for v in (*sizes[0], *sizes[1])]):  # (else checked once)
            for k, name in enumerate(("global_size", "local_size")):
                dims = tuple([get(v) for v in sizes[k]])
                if any([d < 1 for d in dims]):
                    raise InvalidCommand(f"{name!r} must be positive (got {dims})")
                sizes[k] = dims
            prog.check_geometry(*sizes)  # refused where the kernel can't receive it
        gs, ls = sizes
        return cmd.Exec(  # not attrs.evolve: a resubmit rebuilds many of these
            program=prog,
            buffers=c.buffers,
            vals=vals,
            global_size=gs,
            local_size=ls,
            args=prog.c_args(c.buffers, vals, gs, ls),
        )
    if t is cmd.Copy:
        if isinstance(c.nbytes, int):
            return c
        n = get(c.nbytes)
        _check_copy_size(n, c.dest, c.src)
        return attrs.evolve(c, nbytes=n)
    return c
