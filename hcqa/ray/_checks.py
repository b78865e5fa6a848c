"""Checking ``open_ray_pipeline``'s placement against the cluster, and cutting segments.

Theory of operation
-------------------
A placement entry is either a Ray node id (the hex string ``ray.nodes()`` lists as
``NodeID``) or ``{"resources": {"name": amount, ...}}``. Everything that can be checked
without the cluster is checked first (:func:`check_placement`); then, on a worker
thread (``ray.nodes()`` is a call to Ray's control store), the node ids are looked up
among the *alive* nodes and each resource request must fit on one alive node's
*total* resources (:func:`check_cluster`). All of it happens before any actor starts,
and every refusal is an :class:`~hcqa.errors.InvalidCommand` saying what was expected
and what was seen.

Consecutive stages with equal placements form one **segment** (:func:`segments`): one
Ray actor hosting a process pipeline of those stages, or -- when the placement is the
driver's own node -- a process pipeline right in the driver.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from hcqa.errors import InvalidCommand
from hcqa.processes import ProcessStage
from hcqa.processes._checks import out_shape as stage_out_shape

__all__ = ["Placement", "Segment", "check_cluster", "check_placement", "segments"]

_HEX = re.compile(r"^[0-9a-f]+$")


@attrs.frozen
class Placement:
    """Where a stage runs: on the node ``node`` (a hex id), or where ``resources`` fit."""

    node: str | None = None
    resources: tuple[tuple[str, float], ...] = ()

    def describe(self) -> str:
        if self.node is not None:
            return f"node {self.node}"
        return "resources " + ", ".join(f"{k}={v:g}" for k, v in self.resources)


@attrs.frozen(kw_only=True)
class Segment:
    """Consecutive stages ``first .. first + len(stages) - 1`` with one placement."""

    index: int
    first: int
    stages: tuple[ProcessStage, ...]
    placement: Placement
    in_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    out_shape: tuple[int, ...]  # what its last stage gives
    out_dtype: np.dtype[Any]

    @property
    def last(self) -> int:
        return self.first + len(self.stages) - 1

    def describe(self) -> str:
        names = ", ".join(repr(s.fn) for s in self.stages)
        span = (
            f"stage {self.first}" if len(self.stages) == 1 else (f"stages {self.first}-{self.last}")
        )
        return f"{span} ({names})"


def _placement(i: int, entry: object) -> Placement:
    if isinstance(entry, str):
        node = entry.lower()
        if not _HEX.match(node):
            raise InvalidCommand(
                f"placement {i} must be a Ray node id (a hex string, as ray.nodes() lists "
                f"'NodeID') or {{'resources': {{...}}}} (got {entry!r})"
            )
        return Placement(node=node)
    if isinstance(entry, Mapping):
        if set(entry) != {"resources"} or not isinstance(entry["resources"], Mapping):
            raise InvalidCommand(
                f"placement {i} must be {{'resources': {{name: amount, ...}}}} "
                f"(got {dict(entry)!r})"
            )
        res = entry["resources"]
        if not res:
            raise InvalidCommand(f"placement {i}'s resources must name at least one (got {{}})")
        items = []
        for k, v in res.items():
            if not isinstance(k, str) or not k:
                raise InvalidCommand(f"placement {i}'s resource names must be str (got {k!r})")
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float, np.integer, np.floating))
                or not math.isfinite(v)
                or v <= 0
            ):
                raise InvalidCommand(
                    f"placement {i}'s resource {k!r} must be a number > 0 (got {v!r})"
                )
            items.append((k, float(v)))
        return Placement(resources=tuple(sorted(items)))
    raise InvalidCommand(
        f"placement {i} must be a Ray node id (hex str) or {{'resources': {{...}}}} "
        f"(got {type(entry).__name__} {entry!r})"
    )


def check_placement(placement: object, stages: int) -> list[Placement]:
    """Each entry of ``placement`` as a :class:`Placement`, one per stage."""
    if isinstance(placement, (str, bytes, Mapping)) or not isinstance(placement, Sequence):
        raise InvalidCommand(
            f"'placement' must be a list with one entry per stage (got "
            f"{type(placement).__name__} {placement!r})"
        )
    if len(placement) != stages:
        raise InvalidCommand(
            f"'placement' must have one entry per stage (got {len(placement)} for {stages} stages)"
        )
    return [_placement(i, p) for i, p in enumerate(placement)]


def check_cluster(placements: Sequence[Placement]) -> dict[str, str]:
    """Refuse node ids that are not alive nodes and resources no alive node has.

    Returns the alive nodes' ids and addresses. Blocks (a call to Ray's control store):
    run it on a worker thread."""
    import ray

    list_nodes: Callable[[], list[dict[str, Any]]] = ray.nodes
    listed = list_nodes()
    nodes = {n["NodeID"]: n for n in listed if n.get("Alive")}
    for i, p in enumerate(placements):
        if p.node is not None:
            if p.node not in nodes:
                alive = ", ".join(sorted(nodes)) or "none"
                raise InvalidCommand(
                    f"placement {i} must be the id of an alive Ray node (got {p.node!r}; "
                    f"alive: {alive})"
                )
            continue
        want = dict(p.resources)
        fits = [
            n
            for n in nodes.values()
            if all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in want.items())
        ]
        if not fits:
            have: dict[str, float] = {}
            for n in nodes.values():
                for k in want:
                    have[k] = max(have.get(k, 0.0), float(n.get("Resources", {}).get(k, 0.0)))
            seen = ", ".join(f"{k}={v:g}" for k, v in sorted(have.items()))
            raise InvalidCommand(
                f"placement {i}'s resources must fit on one alive node of the cluster "
                f"(asked {p.describe()[len('resources ') :]}; the most any node has: {seen})"
            )
    return {nid: str(n.get("NodeManagerAddress", "")) for nid, n in nodes.items()}


def segments(
    specs: Sequence[ProcessStage],
    placements: Sequence[Placement],
    in_shape: tuple[int, ...],
    dtype: np.dtype[Any],
) -> list[Segment]:
    """Cut the stages into segments of consecutive stages with equal placements."""
    out: list[Segment] = []
    shape, dt = in_shape, dtype
    start = 0
    seg_shape, seg_dt = shape, dt
    for i, spec in enumerate(specs):
        if i > start and placements[i] != placements[start]:
            out.append(
                Segment(
                    index=len(out),
                    first=start,
                    stages=tuple(specs[start:i]),
                    placement=placements[start],
                    in_shape=seg_shape,
                    dtype=seg_dt,
                    out_shape=shape,
                    out_dtype=dt,
                )
            )
            start, seg_shape, seg_dt = i, shape, dt
        shape = stage_out_shape(spec) or shape
        dt = np.dtype(spec.out_dtype or dt)
    out.append(
        Segment(
            index=len(out),
            first=start,
            stages=tuple(specs[start:]),
            placement=placements[start],
            in_shape=seg_shape,
            dtype=seg_dt,
            out_shape=shape,
            out_dtype=dt,
        )
    )
    return out
