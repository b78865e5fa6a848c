"""Opening a process pipeline: checks, workers, the set-up handshake, the close.

Theory of operation
-------------------
:func:`open_process_pipeline` checks every argument (``_checks``), builds the
:class:`~hcqa.processes.pipeline.ProcessPipeline` (its slots and signals) on a private
``cpu:0`` device, forks the workers on a :class:`~hcqa.processes._spawn.ForkThread` and
starts a watcher per worker, then shakes hands in two phases: :func:`_connect` hands
each worker its buffers and signals (fds over its socket) and gets back its eventfds;
:func:`_mesh` gives every participant of a signal the others' eventfds as peers. Only
then are the socket watchers, the reaper and the watchdog started and the pipeline
yielded. A worker that dies during the handshake is a ``DeviceFault`` naming it.

Closing (whatever ends the block): a normal exit drains what was fed (within ``grace``);
then the pipeline is closed -- parked tasks get ``DeviceClosed`` -- the workers are
stopped (killed after ``grace``; at once when the set-up did not finish) and reaped, the
fork thread ends, our views of the shared memory are dropped and, after the device, the
signals are closed. The stop runs shielded but bounded, and waits for each worker's exit
on a pidfd of its own (see ``_spawn``), never on a task the cancellation took away: a
block left by a cancellation (a deadline, a cancelled nursery, Ctrl-C) closes within
``grace``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import numpy as np
import numpy.typing as npt
import trio

from hcqa import aio
from hcqa.devices.opening import open_device
from hcqa.errors import DeviceFault
from hcqa.processes._checks import ProcessStage, check_arguments
from hcqa.processes._spawn import (
    PR_SET_DUMPABLE,
    ForkThread,
    WorkerProcess,
    prctl,
    spawn_worker,
    stop_workers,
    worker_path,
)
from hcqa.processes.ipc import PeerGone, offer_signal, recv_message, send_message
from hcqa.processes.pipeline import ProcessPipeline

__all__ = ["open_process_pipeline"]


@aio.rehosts
@asynccontextmanager
async def open_process_pipeline(
    stages: Sequence[ProcessStage | str],
    *,
    in_shape: Sequence[int] | int,
    dtype: npt.DTypeLike = "float32",
    depth: int = 2,
    grace: float = 5.0,
    hang_limit: float = 30.0,
    blas_threads: int | None = 1,
    path: Sequence[str] = (),
    private: bool = False,
) -> AsyncIterator[ProcessPipeline]:
    """Start a worker process per stage and yield a :class:`ProcessPipeline` over them.

    ``hang_limit``: a stage with work that finishes nothing for that long faults the
    pipeline (every waiting call raises :class:`~hcqa.errors.SignalTimeout` naming the
    stage and its worker's pid) and its workers are killed; ``inf``: no limit.
    ``grace``: on close, how long items already fed may take to finish, and workers to
    exit before they are killed. ``path``: directories the workers import stages from,
    before the coordinator's ``sys.path`` (whose working directory is never used).
    ``private``: make the coordinator and the workers non-dumpable (``PR_SET_DUMPABLE``
    0), so other processes of the same user can't reach the shared memory through
    ``/proc`` -- nor attach a debugger. ``blas_threads`` limits each worker's
    BLAS/OpenMP pool (None: inherit), so the workers, not BLAS threads, are the unit of
    parallelism."""
    specs, shape, dt = check_arguments(
        stages,
        in_shape=in_shape,
        dtype=dtype,
        depth=depth,
        grace=grace,
        hang_limit=hang_limit,
        blas_threads=blas_threads,
        path=path,
    )
    sys_path = worker_path(path)
    if private:
        prctl(PR_SET_DUMPABLE, 0)
    pipe: ProcessPipeline | None = None
    forks: ForkThread | None = None
    try:
        async with open_device("cpu:0") as device:
            pipe = ProcessPipeline(
                device, specs, in_shape=shape, dtype=dt, depth=depth, hang_limit=hang_limit
            )
            error: BaseException | None = None
            started = False  # the block was entered: its workers stop politely
            try:
                async with trio.open_nursery() as nursery:
                    try:
                        forks = ForkThread()
                        for i in range(len(specs)):
                            worker = await forks.call(
                                functools.partial(
                                    spawn_worker, i, blas_threads, sys_path, private=private
                                )
                            )
                            pipe.workers.append(worker)
                            nursery.start_soon(pipe._watch_exit, worker, name=f"worker {i} exit")
                        eventfds = [await _connect(pipe, w) for w in pipe.workers]
                        await _mesh(pipe, eventfds)
                        for w in pipe.workers:
                            nursery.start_soon(pipe._watch, w, name=f"worker {w.index} watch")
                        nursery.start_soon(pipe._reap, name="process pipeline reaper")
                        nursery.start_soon(pipe._watchdog, name="process pipeline watchdog")
                        started = True
                        yield pipe
                        await pipe._drain(grace)
                    except BaseException as exc:
                        error = exc
                    pipe._close()
                    with trio.CancelScope(shield=True):
                        # a set-up that failed or was cancelled: nothing to finish
                        await stop_workers(pipe.workers, grace if started else 0.0)
                    nursery.cancel_scope.cancel()
            finally:
                for w in pipe.workers:
                    w.sock.close()
                    w.reap()
                if forks is not None:
                    forks.close()  # only now: the workers' parent-death signal follows it
                # Drop our numpy views of the shared memory: an mmap can only unmap (and
                # close its own dup of the memfd) once no view exports it.
                for row in pipe.buffers:
                    for b in row:
                        b._array = None
                pipe.buffers = []
                pipe._inputs, pipe._outputs = [], []
                pipe.slot_table._array = None
                pipe._table = np.empty(0, np.int64)
                pipe._rows = memoryview(b"").cast("q")
            if error is not None:
                raise error
    finally:
        # Only now that the device has drained (or dropped) its copies and their
        # Signal commands may the signals go: an engine must never write a closed one.
        if pipe is not None:
            for sig in pipe.signals.values():
                sig.close()


def _stage_signals(i: int) -> list[str]:
    return ["fed" if i == 0 else f"done{i - 1}", f"done{i}"]


async def _died_starting(pipe: ProcessPipeline, worker: WorkerProcess) -> DeviceFault:
    with trio.move_on_after(1):
        await worker.wait_exit()
    code = worker.returncode
    status = "still running" if code is None else f"exit status {code}"
    return DeviceFault(
        f"{pipe._who(worker)} died while starting ({status})", device=f"worker{worker.index}"
    )


async def _connect(pipe: ProcessPipeline, worker: WorkerProcess) -> list[int]:
    """Phase 1: hand the worker its buffers and signals; returns its eventfds."""
    i = worker.index
    fds: list[int] = []
    bufs = []
    for b in (*pipe.buffers[i], *pipe.buffers[i + 1], pipe.slot_table):
        fd, meta = b.export()
        fds.append(fd)
        bufs.append(meta)
    sigs = []
    for name in _stage_signals(i):
        meta, sfds = offer_signal(pipe.signals[name])
        sigs.append(meta)
        fds.extend(sfds)
    header = {
        "op": "setup",
        "stage": pipe.stages[i].fn,
        "args": pipe.stages[i].args,
        "inputs": len(pipe.buffers[i]),
        "outputs": len(pipe.buffers[i + 1]),
        "column": 1 if i == len(pipe.stages) - 1 else 0,  # of the slot table
        "buffers": bufs,
        "signals": sigs,
    }
    try:
        await send_message(worker.sock, header, fds)
        reply, eventfds = await recv_message(worker.sock)
    except (PeerGone, OSError):
        raise await _died_starting(pipe, worker) from None
    if reply.get("op") != "ready" or len(eventfds) != 2:
        for fd in eventfds:
            os.close(fd)
        raise DeviceFault(
            f"{pipe._who(worker)} failed to set up: {reply.get('error', reply)}",
            device=f"worker{i}",
        )
    return eventfds


async def _mesh(pipe: ProcessPipeline, eventfds: list[list[int]]) -> None:
    """Phase 2: every participant of a signal gets the others' eventfds as peers."""
    holders: dict[str, list[tuple[int, int]]] = {}
    for w, fds in zip(pipe.workers, eventfds, strict=True):
        for name, fd in zip(_stage_signals(w.index), fds, strict=True):
            holders.setdefault(name, []).append((w.index, fd))
    for name, held in holders.items():
        for _, fd in held:
            pipe.signals[name].add_peer(fd)  # the coordinator wakes every worker copy
    for w in pipe.workers:
        send: list[int] = []
        names: list[str] = []
        for name in _stage_signals(w.index):
            for j, fd in holders[name]:
                if j != w.index:
                    send.append(fd)
                    names.append(name)
        try:
            await send_message(w.sock, {"op": "peers", "names": names}, send)
        except (PeerGone, OSError):
            raise await _died_starting(pipe, w) from None
