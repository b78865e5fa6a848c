"""Fusion: the fast path a backend may offer for a run of kernels.

Theory of operation
-------------------
A graph replays the same kernels with the same arguments again and again, and a queue
submitted again sends the same commands; dispatching each kernel from Python costs about a
microsecond, for tiny kernels the whole cost. A backend that can run several launches as
one call of its own says so through two methods of its :class:`~hcqa.devices.Device`:

* ``_fusable(exec_)`` -- whether this ``Exec`` may join a fused run (the cpu backend: a C
  kernel whose arguments a table can carry);
* ``_fuse(run)`` -- one command that runs every ``Exec`` of ``run`` (two or more fusable
  launches in a row on one queue), in order: a :class:`FusedRun`. It is called on the
  caller's task (a graph capture's end, a queue's submit), where a compile would stall the
  event loop: it builds nothing new (the cpu backend calls each kernel through its
  trampoline, loaded with the program).

The core does the rest, the same for every backend: :func:`fuse` walks a template (a graph
part's, a built queue's) and replaces each run of fusable launches by the fused command; the
graph and queue machinery (``hcqa/_graph/``) patches a fused run's symbolic entries and
rebinds its buffers through the :class:`FusedRun` interface alone -- it never names a
backend. A new backend gets fused replays by implementing these two methods, its executor's
handler for its fused command, and :class:`FusedRun`.

A fused run is plain data, like every command: ``bound`` makes a new one and never writes
the run it was called on, so a replay still in flight keeps its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hcqa import commands as cmd
from hcqa.variables import Expr, Variable

if TYPE_CHECKING:
    from hcqa.devices.buffer import Buffer

__all__ = ["FusedRun", "access_of", "fuse"]

_SYM = (Variable, Expr)


class FusedRun(cmd.Fused):
    """A command that runs several launches as one call (see the module doc).

    A backend's fused command subclasses this and provides:

    * ``names`` -- the fused kernels' names, in order (a tracer shows them as one range);
    * :meth:`access` -- the buffers it reads before writing them and those it writes
      (:func:`access_of` of its launches; rebound ones after a ``bound``): a batch that
      fails does not run it and marks what it was to write as holding no valid data, and
      a batch queued behind that reads it fails too (``actors/actor.py``);
    * ``symbols`` -- the distinct symbolic ints (Variables, expressions) its arguments hold,
      in a fixed order; empty when every argument is known;
    * :meth:`buffers` -- the buffers it touches (a graph rebinds them on replay);
    * :meth:`bound` -- the same run with the symbols' ``values`` filled in (each
      range-checked: :class:`~hcqa.errors.InvalidCommand` when one does not fit) and the
      buffers of ``rebind`` replaced; a new object, this one unchanged.
    """

    __slots__ = ()

    names: tuple[str, ...]
    symbols: tuple[Any, ...]

    def buffers(self) -> tuple[Buffer, ...]:
        raise NotImplementedError

    def bound(
        self, values: Mapping[Any, int] | None, rebind: Mapping[Buffer, Buffer] | None
    ) -> FusedRun:
        raise NotImplementedError


def access_of(run: Sequence[cmd.Exec]) -> tuple[tuple[Buffer, ...], tuple[Buffer, ...]]:
    """What the launches of ``run``, in order, read before writing it (a buffer of an
    allocation an earlier launch of the run wrote is not read from outside), and what they
    write: a fused run's :meth:`FusedRun.access`, as its launches would report one by one."""
    reads: dict[int, Any] = {}
    writes: dict[int, Any] = {}
    for e in run:
        written, read = e.program.access(len(e.buffers))
        for i in read:
            b = e.buffers[i]
            key = id(b._hazards)  # type: ignore[attr-defined]
            if key not in writes:
                reads.setdefault(key, b)
        for i in written:
            b = e.buffers[i]
            writes.setdefault(id(b._hazards), b)  # type: ignore[attr-defined]
    return tuple(reads.values()), tuple(writes.values())


Patch = tuple[int, str, Any]  # (template index, kind, data)


def fuse(template: list[Any], patches: list[Patch]) -> tuple[list[Any], list[Patch], int]:
    """Replace each run of two or more fusable launches in ``template`` by the fused command
    their device makes (``Device._fuse``); the new template, the patch slots moved to their
    new positions, and how many runs were fused.

    ``template`` holds commands and ``None`` holes for the patches; ``patches`` lists the
    holes as (index, kind, data). Launches -- symbolic or not -- sit in the template itself.
    A fused run with symbols leaves a ``"run"`` patch slot (the run), a symbolic launch left
    alone a ``"command"`` slot (the launch)."""
    patched = {i for i, _, _ in patches}
    out: list[Any] = []
    extra: list[Patch] = []
    remap: dict[int, int] = {}
    run: list[cmd.Exec] = []
    made = 0

    def flush() -> None:
        nonlocal made
        if len(run) >= 2:
            fused = run[0].program.device._fuse(run)
            if fused.symbols:
                extra.append((len(out), "run", fused))
                out.append(None)
            else:
                out.append(fused)
            made += 1
        else:
            for e in run:
                if not _static(e):
                    extra.append((len(out), "command", e))
                    out.append(None)
                else:
                    out.append(e)
        run.clear()

    for i, c in enumerate(template):
        if i not in patched and isinstance(c, cmd.Exec):
            if c.program.device._fusable(c):  # (a template is one queue's: one device)
                run.append(c)
                continue
            if not _static(c):
                flush()
                extra.append((len(out), "command", c))
                out.append(None)
                continue
        flush()
        remap[i] = len(out)
        out.append(c)
    flush()
    moved = [(remap[i], kind, data) for i, kind, data in patches]
    return out, sorted(moved + extra, key=lambda p: p[0]), made


def _static(e: cmd.Exec) -> bool:
    """Whether every val and launch size of ``e`` is a plain int."""
    return not any(isinstance(v, _SYM) for v in (*e.vals, *e.global_size, *e.local_size))
