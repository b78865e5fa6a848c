"""The worker process of a process pipeline (started by ``hcqa.processes._spawn``).

Theory of operation
-------------------
The coordinator starts this module (see ``_spawn``: isolated, the coordinator's hcqa,
no working directory on the path) with one end of a Unix socketpair. The worker first
asks the kernel to SIGKILL it when the coordinator dies (``PR_SET_PDEATHSIG``) and checks
the coordinator is still its parent; it then checks its peer's credentials, receives its set-up --
the stage (``"module:function"``, or a factory and its arguments), its input and output
slots as memfds, and its three signals -- maps them, sends back its own eventfds,
receives its peers' and then runs the stage in its engine thread (:func:`_stage_loop`),
asleep in a blocking read of its input signal's eventfd between items. Its trio side
only watches the socket: on ``stop`` or the coordinator's end closing the process exits
at once (``os._exit``: a stage stuck in a call does not hold it, and the interpreter's
slow teardown is skipped). A stage that raises sends its error back as a ``fault`` message.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import numpy.typing as npt
import trio

from hcqa.devices.opening import open_device
from hcqa.errors import DeviceClosed, InvalidCommand
from hcqa.processes._spawn import PR_SET_DUMPABLE, PR_SET_PDEATHSIG, prctl
from hcqa.processes.ipc import PeerGone, attach_signal, check_peer, recv_message, send_message
from hcqa.signals import Signal

__all__ = ["main"]


def _load(ref: str) -> Callable[..., Any]:
    module, _, name = ref.partition(":")
    if not module or not name:
        raise InvalidCommand(f"a stage must be named 'module:function' (got {ref!r})")
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise InvalidCommand(
            f"stage {ref!r}: module {exc.name!r} was not found on the workers' path (the "
            "coordinator's sys.path without its working directory, plus path=[...])"
        ) from exc
    for part in name.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise InvalidCommand(f"stage {ref!r} must name a callable (got {type(obj).__name__})")
    return obj  # type: ignore[no-any-return]


async def _worker_main(fd: int) -> None:
    raw = socket.socket(fileno=fd)
    sock = trio.socket.from_stdlib_socket(raw)
    check_peer(sock)
    header, fds = await recv_message(sock)
    try:
        fn = _load(header["stage"])
        if header.get("args") is not None:
            fn = fn(**header["args"])
            if not callable(fn):
                raise InvalidCommand(f"stage factory {header['stage']!r} must return a callable")
    except Exception as exc:
        await send_message(sock, {"op": "error", "error": f"{type(exc).__name__}: {exc}"})
        return
    n_in, n_out, column = int(header["inputs"]), int(header["outputs"]), int(header["column"])

    try:
        async with open_device("cpu:0") as device:
            metas = header["buffers"]
            buffers = [
                device.import_buffer(
                    bfd,
                    m["nbytes"] + m["offset"],
                    offset=m["offset"],
                    dtype=m["dtype"],
                    shape=m["shape"],
                )
                for bfd, m in zip(fds[: len(metas)], metas, strict=True)
            ]
            sfds = fds[len(metas) :]
            sigs = [
                attach_signal(m, sfds[2 * j : 2 * j + 2]) for j, m in enumerate(header["signals"])
            ]
            own = [os.dup(s.fd) for s in sigs]
            await send_message(sock, {"op": "ready"}, own)
            for efd in own:
                os.close(efd)
            peers, pfds = await recv_message(sock)
            by_name = {s.name: s for s in sigs}
            for name, pfd in zip(peers["names"], pfds, strict=True):
                by_name[name].add_peer(pfd)
            inp, done = sigs
            # ``done``'s peers: the coordinator's eventfd (attached first), then the next
            # stage's. Nothing in the coordinator sleeps on an intermediate ``done`` (its
            # watchdog reads the values), so only the last stage -- the one its callers
            # wait on -- wakes it; an intermediate stage wakes the next stage alone.
            # (The stage thread, the only writer, has not started yet.)
            if column == 0 and len(done._peers) > 1:
                os.close(done._peers.pop(0))
            ins = [b._kernel_array() for b in buffers[:n_in]]
            outs = [b._kernel_array() for b in buffers[n_in : n_in + n_out]]
            table = buffers[n_in + n_out]._kernel_array()

            async def engine() -> None:
                error = await trio.to_thread.run_sync(
                    _stage_loop, fn, ins, outs, table, column, inp, done
                )
                if error is not None:
                    text = f"{type(error).__name__}: {error}"
                    with contextlib.suppress(PeerGone, OSError):
                        await send_message(sock, {"op": "fault", "error": text})

            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine)
                while True:
                    try:
                        message, extra = await recv_message(sock)
                    except PeerGone:
                        break
                    for e in extra:
                        os.close(e)
                    if message.get("op") == "stop":
                        break
                # Stopped, or the coordinator is gone: leave now. The stage thread may be
                # stuck in a call; nothing of this process needs an orderly teardown.
                os._exit(0)
    except Exception as exc:  # set-up failed: say why (the coordinator raises it)
        with contextlib.suppress(PeerGone, OSError):
            await send_message(sock, {"op": "error", "error": f"{type(exc).__name__}: {exc}"})


def _stage_loop(
    fn: Callable[..., Any],
    ins: list[npt.NDArray[Any]],
    outs: list[npt.NDArray[Any]],
    table: npt.NDArray[Any],
    column: int,
    inp: Signal,
    done: Signal,
) -> BaseException | None:
    """The worker's engine thread: item after item, sleeping on the signals' eventfds.

    Item ``k`` reads input slot ``table[k % depth, 0]`` and writes output slot
    ``table[k % depth, column]`` (the last stage may write a loan slot). Returns None
    when stopped (the signals were broken), or the stage's error.

    Between items the thread sleeps in a plain blocking ``read(2)`` of its input
    signal's eventfd -- one syscall a hop, no timer -- rather than a ``Signal`` wait
    (``poll`` with a timeout, then a read). That is sound because this thread is the
    eventfd's only reader in this process, and every producer of the input writes the
    value and *then* the eventfd: the coordinator's ``_feed`` and the previous stage's
    loop (both through ``_set_from_engine``, which writes every peer), and a break
    (``Signal._break``). So the timed re-read a ``Signal`` wait keeps for producers
    that write memory only is not needed here, and an idle worker makes no wake-up at
    all. The eventfd is made blocking for this: only this thread reads it, and an
    eventfd write never blocks (the counter can't get near its limit)."""
    depth = len(table)
    # row r of the table is rows[2 r], rows[2 r + 1] (a cast never copies: it refuses a
    # table that is not one contiguous buffer)
    rows = table.data.cast("B").cast("q")
    efd = inp.fd
    os.set_blocking(efd, True)
    inp._alone = True  # a value set in this process writes the eventfd too
    value = inp._value
    read = os.eventfd_read
    k = 0
    try:
        while True:
            k += 1
            # item k's input is in place, and its slots in the table
            while value.value < k:
                if inp._broken is not None:
                    inp._raise_broken()
                read(efd)  # the GIL is released while blocked
            row = 2 * (k % depth)
            fn(outs[rows[row + column]], ins[rows[row]])
            done._set_from_engine(k)
    except DeviceClosed:
        return None
    except BaseException as exc:
        return exc


def main(config: dict[str, Any]) -> None:
    """The worker's entry point (``config``: see ``_spawn.spawn_worker``)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the coordinator's trio thread
    if os.getppid() != config["parent"]:
        os._exit(1)  # the coordinator died before the line above: nobody to serve
    if config.get("private"):
        prctl(PR_SET_DUMPABLE, 0)  # /proc/PID/fd and ptrace: root only
    trio.run(_worker_main, int(config["fd"]))
    os._exit(0)
