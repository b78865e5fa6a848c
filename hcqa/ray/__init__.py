"""Past one host: pipeline stages placed on Ray nodes (``pip install -e '.[ray]'``).


Theory of operation
-------------------
hcqa grows no cluster of its own: Ray places the work, moves the items between hosts
and tells us when a node dies; hcqa keeps its fast path inside each host.

Segments
    :func:`open_ray_pipeline` takes the stages of a process pipeline and a placement per
    stage (a Ray node id, or ``{"resources": {...}}``). Consecutive stages with the same
    placement form a **segment**: one :func:`~hcqa.processes.open_process_pipeline` on
    that node, so items move between its stages through shared memory with nothing but
    signal writes per item. A remote segment is hosted by a threaded Ray actor
    (``_segment``: its trio loop runs in a thread of the actor); a segment
    placed on the driver's own node runs right in the driver (``local=True``), which
    saves the two Ray hops into and out of an actor.

How an item travels
    Callers park on an event; the items ready at one moment are cut into **batches** of
    at most ``depth`` items, and a batch walks the segments in order: a remote segment
    is one actor call, ``actor.run.remote(value)``, where ``value`` is the previous
    segment's ObjectRef -- Ray resolves it node to node, the driver is not on the path
    -- or the items themselves. One call per batch per hop, not per item: Ray's
    per-call cost (a millisecond or more on a small host) is paid once for every item
    that was ready. Only the last ObjectRef (or a local segment's input) is waited for
    in the driver, woken by Ray's callback (``_batches.resolve``), never by polling. At most
    ``depth`` items per segment are in flight; further callers wait, FIFO. A small batch
    crosses Ray as one bytes object (``_segment.pack``); a big one (over 64 KiB) holds
    its *leg* -- the run of remote segments it is in -- until it is back, and big
    batches arriving meanwhile wait and go on merged (``_batches``): Ray's transfers
    between nodes collapse when several run at once.

Faults and hangs
    A stage that raises faults its segment's process pipeline; the actor re-raises that
    fault as a :class:`~hcqa.errors.DeviceFault` naming the stage (its index in the
    whole pipeline and its function) and the node (id and address). A dead actor or
    node (``RayActorError``, ``ObjectLostError``, ...) is a ``DeviceFault`` naming the
    segment and its node. Either is **sticky**: every waiting call and every later one
    raises that instance, and the actors are killed. Hangs: each segment's process
    pipeline watches its own stages with ``hang_limit`` and its
    :class:`~hcqa.errors.SignalTimeout` names the stalled stage, worker and node. The
    driver's watchdog (asleep while idle) is the backstop for what cannot report -- a
    node cut off before Ray declares it dead: no batch leaving any segment for 1.5 x
    ``hang_limit`` while items are in flight is a ``SignalTimeout`` naming the segment.

Cancellation and closing
    A cancelled caller's item finishes and is dropped; results are matched to callers
    by their place in their own batch, so nobody is handed another's result, and the
    cancelled item's place in flight comes back only when its batch ends. Closing
    drains the items in flight (within ``grace``; callers still waiting for a place get
    none), wakes every waiting call with :class:`~hcqa.errors.DeviceClosed`, closes each
    actor's pipeline, kills the actors and waits until Ray reports them dead and their
    resources free (``opening``).
"""

from __future__ import annotations

from hcqa.errors import install_hint

try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"hcqa.ray needs Ray: {install_hint('ray')}") from exc

from hcqa.ray.opening import open_ray_pipeline
from hcqa.ray.pipeline import RayPipeline, RayPipelineStatistics

__all__ = ["RayPipeline", "RayPipelineStatistics", "open_ray_pipeline"]
