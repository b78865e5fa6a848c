"""Cutting a lifted model into pipeline stages: where to cut, and what crosses each cut.

Theory of operation
-------------------
This module is plain planning over the records of :mod:`hcqa.models.lifted`; nothing here
allocates or runs. :func:`plan` takes the kernels in their captured order and a number of
stages and returns a :class:`Plan`.

**Where.** Stages are contiguous runs of kernels. Each kernel costs what the front end
estimated for it (:func:`cost`: its operations plus the bytes it touches, both from tinygrad's
own per-kernel estimates), and the cut points minimise the costliest stage (the pipeline's
throughput is the slowest stage's): a dynamic programme over prefix sums, exact for contiguous
stages. Counting kernels instead would put a matmul and a softmax's five small reductions on
equal footing. ``cuts=`` overrides the choice (kernel indices where stages 1.. start).

**What crosses.** On one device the model's buffers are *bases* (allocations) and its kernel
arguments byte ranges of them (*views*: on the CPU, tinygrad's memory planner packs
intermediates into one arena and reuses its bytes). Each stage's device gets its own copy of
every base its kernels touch, at the same offsets, so each kernel runs unchanged. Walking the
kernels in order, each base keeps an interval map of which stages hold the current bytes of
each range. A kernel's read of a range that its stage does not hold becomes a :class:`Move`
of exactly that range (not the whole base, not the whole arena) from the latest stage that
holds it, placed at the start of the reading stage; a write makes its stage the only holder.
Stages are contiguous, so a stage sees other stages' bytes only as they were at its start,
and every move can run there. Model inputs are copied in from the host to each stage that
reads them; each output is copied out from a stage that holds all of it (or moved to the
last stage first).

Weights (never written) are copied once to each device that reads them. A *state* base whose
bytes a call reads before writing them (a KV cache; with Variables, any state base a kernel
reads: a write may cover only the row a Variable picks) must stay on one stage, shared by every
microbatch: the balance only cuts outside the kernels that use it, and ``cuts=`` that split it
are refused. A state base written before it is read is per-call scratch.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from hcqa.errors import InvalidCommand
from hcqa.models.lifted import Arg, Kernel, Lifted

__all__ = ["HOST", "Move", "Plan", "StagePlan", "cost", "plan"]

HOST = -1  # a holder: the bytes are the host's (an input not copied in yet)
INIT = -2  # a holder: the bytes are the ones loaded with the model (state)


def cost(k: Kernel) -> int:
    """A kernel's estimated cost: the front end's operation count plus the bytes it touches
    (about one operation per byte: a CPU core's balance of arithmetic and memory traffic)."""
    return max(1, k.ops + k.mem)


@attrs.frozen
class Move:
    """``nbytes`` bytes of base ``base`` from ``offset``, from stage ``src``'s device to stage
    ``dst``'s, before stage ``dst`` runs (or, for an output, after the last stage ran)."""

    base: int
    offset: int
    nbytes: int
    src: int
    dst: int


@attrs.frozen
class StagePlan:
    """One stage: kernels ``start:stop``, what it holds, and what arrives before it runs."""

    start: int
    stop: int
    cost: int
    bases: tuple[int, ...]  # per-call bases its device holds a copy of (per slot)
    weights: tuple[int, ...]  # weights it reads (one copy per device)
    inputs: tuple[int, ...]  # model inputs (by position) copied in from the host
    moves: tuple[Move, ...]  # ranges copied in from other stages before it runs


@attrs.frozen
class Plan:
    stages: tuple[StagePlan, ...]
    outputs: tuple[int, ...]  # per model output: the stage it is copied out from
    final: tuple[Move, ...]  # output ranges moved to the last stage after it runs
    state: dict[int, int]  # state bases read before written -> their one stage

    @property
    def moves(self) -> tuple[Move, ...]:
        return tuple(m for s in self.stages for m in s.moves) + self.final


def balance(costs: Sequence[int], n: int, forbidden: frozenset[int] = frozenset()) -> list[int]:
    """The ``n - 1`` cut points (indices where stages 1.. start) that minimise the costliest
    of ``n`` contiguous, non-empty stages of ``costs``, none of them in ``forbidden``
    (``[]`` for ``n > 1`` when there is no such cut)."""
    k = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: the least possible max stage cost of the first i kernels in j stages
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    back = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for j in range(1, n + 1):
        for i in range(j, k - (n - j) + 1):
            for m in range(j - 1, i):
                if j > 1 and m in forbidden:
                    continue
                worst = max(best[j - 1][m], prefix[i] - prefix[m])
                if worst < best[j][i]:
                    best[j][i], back[j][i] = worst, m
    if best[n][k] == inf:
        return []
    cuts: list[int] = []
    i = k
    for j in range(n, 1, -1):
        i = back[j][i]
        cuts.append(i)
    return cuts[::-1]


@attrs.define
class _Seg:
    lo: int
    hi: int
    holders: frozenset[int]


class _Holders:
    """Per base, an interval map: sorted segments covering the base, each with the stages
    (or HOST / INIT) that hold its current bytes."""

    def __init__(self, nbytes: int, initial: frozenset[int]) -> None:
        self.segs = [_Seg(0, nbytes, initial)]

    def _split(self, at: int) -> None:
        for i, seg in enumerate(self.segs):
            if seg.lo < at < seg.hi:
                self.segs[i : i + 1] = [
                    _Seg(seg.lo, at, seg.holders),
                    _Seg(at, seg.hi, seg.holders),
                ]
                return

    def span(self, lo: int, hi: int) -> list[_Seg]:
        self._split(lo)
        self._split(hi)
        return [seg for seg in self.segs if lo <= seg.lo and seg.hi <= hi]


def _check_cuts(cuts: Sequence[int], n: int, k: int) -> list[int]:
    if isinstance(cuts, (str, bytes)) or not isinstance(cuts, Sequence):
        raise InvalidCommand(f"'cuts' must be a sequence of kernel indices (got {cuts!r})")
    out = list(cuts)
    if len(out) != n - 1:
        raise InvalidCommand(f"'cuts' must hold {n - 1} index(es) for {n} stages (got {len(out)})")
    last = 0
    for c in out:
        if isinstance(c, bool) or not isinstance(c, int) or not last < c < k:
            raise InvalidCommand(
                f"'cuts' must be increasing kernel indices in [1, {k - 1}] (got {tuple(cuts)})"
            )
        last = c
    return out


def kept(lifted: Lifted) -> dict[int, tuple[int, int]]:
    """The state bases a call may read as an earlier call left them, each with the first and
    last kernel that touch it: those stay on one stage. A read before any write of its bytes
    shows it; with Variables, every state base read at all counts (a kernel may write a part
    of its argument chosen by a Variable -- a cache's row -- and the rest must persist)."""
    holders = {
        i: _Holders(b.nbytes, frozenset({INIT}))
        for i, b in enumerate(lifted.bases)
        if b.role == "state"
    }
    found: set[int] = set()
    span: dict[int, tuple[int, int]] = {}
    for n, k in enumerate(lifted.kernels):
        for i in (*k.reads, *k.writes):
            b = k.args[i].base
            if b in holders:
                span[b] = (span.get(b, (n, n))[0], n)
        for i in k.reads:
            a = k.args[i]
            if a.base in holders:
                segs = holders[a.base].span(a.offset, a.offset + a.nbytes)
                if lifted.variables or any(INIT in seg.holders for seg in segs):
                    found.add(a.base)
        for i in k.writes:
            a = k.args[i]
            if a.base in holders:
                for seg in holders[a.base].span(a.offset, a.offset + a.nbytes):
                    seg.holders = frozenset({0})
    return {b: span[b] for b in sorted(found)}


def plan(lifted: Lifted, n: int, cuts: Sequence[int] | None = None) -> Plan:
    """Cut ``lifted`` into ``n`` stages (see the module doc)."""
    kernels = lifted.kernels
    costs = [cost(k) for k in kernels]
    together = kept(lifted)
    if cuts is None:
        forbidden = frozenset(c for lo, hi in together.values() for c in range(lo + 1, hi + 1))
        points = balance(costs, n, forbidden)
        if n > 1 and not points:
            raise InvalidCommand(
                f"the model can't be cut into {n} stages that each keep its state (caches "
                f"kept across calls: {len(together)} buffer(s), used by kernels "
                f"{sorted(together.values())}) on one stage; use fewer devices"
            )
    else:
        points = _check_cuts(cuts, n, len(kernels))
    bounds = list(zip([0, *points], [*points, len(kernels)], strict=True))
    roles = [b.role for b in lifted.bases]
    holders: dict[int, _Holders] = {}
    for i, b in enumerate(lifted.bases):
        if b.role != "weight":
            start = {"input": HOST, "state": INIT}.get(b.role)
            holders[i] = _Holders(b.nbytes, frozenset() if start is None else frozenset({start}))
    touched: list[set[int]] = [set() for _ in range(n)]
    weights: list[set[int]] = [set() for _ in range(n)]
    inputs: list[set[int]] = [set() for _ in range(n)]
    moves: list[list[Move]] = [[] for _ in range(n)]
    persistent: set[int] = set(together)
    slot_of = {b: lifted.bases[b].slot for b in range(len(roles)) if roles[b] == "input"}

    def read(s: int, arg: Arg, into: list[Move]) -> None:
        if roles[arg.base] == "weight":
            weights[s].add(arg.base)
            return
        touched[s].add(arg.base)
        for seg in holders[arg.base].span(arg.offset, arg.offset + arg.nbytes):
            lo, hi, h = seg.lo, seg.hi, seg.holders
            if s in h or not h:
                continue
            if INIT in h:
                persistent.add(arg.base)
                continue
            if HOST in h:  # an input, copied in whole from the host at the stage's start
                slot = slot_of[arg.base]
                assert slot is not None
                inputs[s].add(slot)
                for whole in holders[arg.base].span(0, lifted.bases[arg.base].nbytes):
                    whole.holders = whole.holders | {s}
                continue
            src = max(h)
            if (
                into
                and (m := into[-1]).base == arg.base
                and m.src == src
                and m.offset + m.nbytes == lo
            ):
                into[-1] = attrs.evolve(m, nbytes=m.nbytes + hi - lo)
            else:
                into.append(Move(arg.base, lo, hi - lo, src, s))
            seg.holders = h | {s}

    for s, (start, stop) in enumerate(bounds):
        for k in kernels[start:stop]:
            for i in k.reads:
                read(s, k.args[i], moves[s])
            for i in k.writes:
                a = k.args[i]
                touched[s].add(a.base)
                for seg in holders[a.base].span(a.offset, a.offset + a.nbytes):
                    seg.holders = frozenset({s})
    state: dict[int, int] = {}
    for p in sorted(persistent):
        where = [s for s in range(n) if p in touched[s]]
        if len(where) > 1:
            raise InvalidCommand(
                f"state buffer {p} ({lifted.bases[p].nbytes} bytes, read before it is written: "
                f"a cache kept across calls) is used by stages {where}: a model's state must "
                "stay on one stage; pass cuts=... that keep it together"
            )
        state[p] = where[0]
    outputs: list[int] = []
    final: list[Move] = []
    for _, arg in lifted.outputs:
        segs = holders[arg.base].span(arg.offset, arg.offset + arg.nbytes)
        common = set(range(n))
        for seg in segs:
            common &= seg.holders
        if common:
            outputs.append(max(common))
            continue
        read(n - 1, arg, final)
        outputs.append(n - 1)
    stages = tuple(
        StagePlan(
            start=start,
            stop=stop,
            cost=sum(costs[start:stop]),
            bases=tuple(sorted(b for b in touched[s] if b not in state)),
            weights=tuple(sorted(weights[s])),
            inputs=tuple(sorted(inputs[s])),
            moves=tuple(moves[s]),
        )
        for s, (start, stop) in enumerate(bounds)
    )
    return Plan(stages=stages, outputs=tuple(outputs), final=tuple(final), state=state)
