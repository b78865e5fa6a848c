"""Process pipelines: stages in worker processes, items in shared slots, nothing spins.

Theory of operation
-------------------
:func:`open_process_pipeline` starts one worker process per stage (``_spawn``), each
owning its own ``cpu:0`` device, and connects to each with a Unix socketpair
(``ipc``). Everything the stages share is created by the coordinator and *handed over
as fds*: the **slots** (memfds: each stage's input and output buffers, so the output of
stage ``i`` is the very memory stage ``i + 1`` reads), the **slot table** (which slot
item ``k`` uses) and the **signals** that order them -- ``fed`` (items whose input is in
place and whose row of the table is written) and ``done{i}`` (items stage ``i`` has
finished). Worker ``i`` runs its stage in its engine thread (``_worker``): it sleeps on
its input signal, runs ``fn(out, inp)`` on item ``k``'s slot and sets ``done{i} = k``;
nothing but signal writes crosses processes per item, and every process sleeps on its
own eventfd (the coordinator meshes them as peers), so an idle pipeline costs no CPU.

Slots, loans and the slot table (``_pool``)
    ``depth`` slots bound the items in flight; an item takes one (waiting, FIFO, while
    all are taken: backpressure) and gets the next item number ``k``, and its row of
    the table is ``k % depth``. A large result is *lent*: the last stage writes it into
    one of ``loans`` spare output slots and the caller gets an array over that memory
    (``_items``), whose loan comes back when the array and its views are collected.

Who frees what, and when
    A slot (and its loan) goes back to the pool **only once its item has left every
    stage** -- the last stage's ``done`` reached ``k``. The caller's task releases its
    item in one ``finally`` whatever happened: completed (free now), cancelled at any
    await or its ``item()`` block left early (the item is fed anyway -- with whatever
    its slot holds -- so the items behind it are not stalled, and it is *retired*:
    freed by the reaper task, which sleeps on the last stage's signal, or by the next
    completion), faulted (retired; a faulted pipeline takes no more items). Inputs too
    large to copy on the loop go through the copy engine, and that copy is shielded: a
    cancelled caller can't leave the engine writing a slot it has fed.

Why no slot is handed out twice
    Freeing is a pure function of one monotonic value (the last stage's ``done``), checked
    and acted on without an await between, on the trio thread: cancellation, an
    abandoned block, completion and a fault can change *when* the caller lets go, never
    *whether* the item is finished. A freed slot goes straight to the first waiter. And
    the table row ``k % depth`` is rewritten only by item ``k + depth``, which needs a
    free slot, which needs ``depth`` finished items -- so item ``k`` (items leave the last
    stage in order) is finished with its row. Workers never free anything.

Faults, hangs and closing
    A worker that dies, or whose stage raises, faults the pipeline: its signals are
    broken with a sticky :class:`~hcqa.errors.DeviceFault` naming the worker, so every
    waiting call fails fast. A watchdog task (a timer, asleep while the pipeline is
    idle) faults it with :class:`~hcqa.errors.SignalTimeout` when a stage that has work
    finishes nothing for ``hang_limit`` seconds (stuck, SIGSTOPped), naming the stage and
    its pid, and kills the workers. Closing drains what was fed (within ``grace``) on a
    normal exit, then wakes every task parked on the pipeline -- slot waiters included --
    with :class:`~hcqa.errors.DeviceClosed`, stops the workers (killing them after
    ``grace``) and closes every fd.

What a worker can't do to the coordinator
    The shared memfds are sealed against shrinking (``F_SEAL_SHRINK``), so a stage that
    truncates one gets ``EPERM`` instead of making the coordinator die of SIGBUS.
    Workers die with the coordinator (``PR_SET_PDEATHSIG``, and they exit when their
    socket closes) and import nothing from its working directory. Any process of the
    same user can still open the shared memory through ``/proc/PID/fd``: that is the
    trust boundary (docs/processes.md); ``private=True`` narrows it to root.

The former home
    ``hcqa.workers`` is where process pipelines lived first. It re-exports this package's
    names and the stock stages (``stages.py``: ``add_one``, ``identity``) so that stage names
    such as ``"hcqa.workers:add_one"`` and ``from hcqa.workers import ...`` keep working; it
    sits in the same layer as this package's users and holds no code of its own.
"""

from __future__ import annotations

from hcqa.processes._checks import ProcessStage
from hcqa.processes.opening import open_process_pipeline
from hcqa.processes.pipeline import PipelineItem, ProcessPipeline, ProcessPipelineStatistics

__all__ = [
    "PipelineItem",
    "ProcessPipeline",
    "ProcessPipelineStatistics",
    "ProcessStage",
    "open_process_pipeline",
]
