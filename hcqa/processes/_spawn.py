"""Starting, watching and stopping a process pipeline's workers.

Theory of operation
-------------------
A worker is started as ``python -I -c BOOT`` with one end of a fresh socketpair as its
only inherited fd. ``-I`` (isolated mode) keeps the coordinator's working directory,
``PYTHONPATH`` and the user site out of its start-up; ``BOOT`` then sets ``sys.path`` to
the coordinator's own, *minus its working directory* (``''`` and ``os.getcwd()``), after
the caller's ``path=`` entries, and loads ``hcqa`` from the very directory the
coordinator's came from -- so a module planted in the working directory is never
imported, and the worker runs the same hcqa as the coordinator.

The kernel's parent-death signal follows the *thread* that forked, so workers are
forked neither on trio's thread cache (an idle cached thread exits, and would take the
workers with it) nor on the trio thread (a fork and exec blocks it for milliseconds),
but on a :class:`ForkThread` of the pipeline's own, which lives until its workers are
reaped. The worker's ``PR_SET_PDEATHSIG`` (SIGKILL, set first thing, after which it
checks its parent is still the coordinator) then fires when the coordinator dies,
whatever the worker is doing. The worker also exits at once when its socket closes.

The coordinator waits for a worker's exit on a pidfd (:meth:`WorkerProcess.wait_exit`):
the first waiter sleeps on the pidfd opened at spawn, any other on one of its own, and
whoever wakes first reaps the worker. No wait depends on another task: a close that
runs after a cancellation has taken the watcher tasks away still sees every worker
exit. Killing goes through the ``Popen`` object, which is safe against pid reuse until
the child is reaped (and every reap happens on the trio thread, between awaits).
:func:`stop_workers` bounds the polite part (the stop message and the exits) by
``grace`` and then kills, so a close always ends.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import outcome
import trio

from hcqa.processes.ipc import PeerGone, check_peer, send_message

__all__ = [
    "PR_SET_DUMPABLE",
    "PR_SET_PDEATHSIG",
    "ForkThread",
    "WorkerProcess",
    "prctl",
    "spawn_worker",
    "stop_workers",
    "worker_path",
]

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4


def prctl(option: int, value: int) -> None:
    """Linux ``prctl(option, value)`` through libc."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}): {os.strerror(err)}")


_BOOT = """\
import importlib.util as u, json, sys
c = json.loads(sys.argv[1])
sys.path[:] = c["path"]
s = u.spec_from_file_location("hcqa", c["init"], submodule_search_locations=[c["dir"]])
m = u.module_from_spec(s); sys.modules["hcqa"] = m; s.loader.exec_module(m)
from hcqa.processes._worker import main
main(c)
"""


def worker_path(extra: Sequence[str] = ()) -> list[str]:
    """The workers' ``sys.path``: ``extra`` first, then the coordinator's own without its
    working directory (relative entries made absolute)."""
    cwd = os.getcwd()
    out = [os.path.abspath(e) for e in extra]
    for entry in sys.path:
        if entry in ("", ".") or os.path.abspath(entry) == cwd:
            continue
        entry = os.path.abspath(entry)
        if entry not in out:
            out.append(entry)
    return out


T = TypeVar("T")


class ForkThread:
    """A thread that forks a pipeline's workers and lives until they are reaped."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="hcqa process-pipeline forks", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on this thread (not cancellable: a fork takes milliseconds)."""
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        def job() -> None:
            result = outcome.capture(fn)
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        self._jobs.put(job)

        def abort(_: Any) -> trio.lowlevel.Abort:
            return trio.lowlevel.Abort.FAILED

        value: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return value

    def close(self) -> None:
        """After the workers are reaped: the thread ends (promptly)."""
        self._jobs.put(None)
        self._thread.join()


class WorkerProcess:
    """A started worker: its ``Popen``, a pidfd to wait on, its end of the socketpair."""

    def __init__(self, index: int, popen: subprocess.Popen[bytes], sock: trio.socket.SocketType):
        self.index = index
        self.popen = popen
        self.sock = sock
        self.pidfd = os.pidfd_open(popen.pid)
        self._pidfd_busy = False  # a task sleeps on ``pidfd``
        self.exited = trio.Event()
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    async def wait_exit(self) -> int:
        """Until the worker has exited; reaps it and returns its status. Any number of
        tasks may wait, each on a pidfd (the spawn's, or its own while another task
        sleeps on that one), so no wait relies on a task that may have been cancelled."""
        while (code := self.popen.poll()) is None:
            own = self._pidfd_busy or self.pidfd < 0
            fd = os.pidfd_open(self.popen.pid) if own else self.pidfd
            if not own:
                self._pidfd_busy = True
            try:
                await trio.lowlevel.wait_readable(fd)
            finally:
                if own:
                    trio.lowlevel.notify_closing(fd)
                    os.close(fd)
                else:
                    self._pidfd_busy = False
        self.returncode = code
        self.exited.set()
        return code

    def kill(self) -> None:
        if self.popen.returncode is None:
            self.popen.send_signal(signal.SIGKILL)

    def reap(self) -> None:
        """Last resort at close (every wait is over): kill and wait, blocking briefly."""
        if self.popen.returncode is None:
            self.kill()
            self.popen.wait()
        if self.pidfd >= 0:
            trio.lowlevel.notify_closing(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = -1


def spawn_worker(
    index: int, blas_threads: int | None, path: Sequence[str], *, private: bool
) -> WorkerProcess:
    """Start a worker (call it on a :class:`ForkThread`: see the theory above)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    if blas_threads is not None:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(blas_threads)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hcqa/
    config = {
        "fd": child.fileno(),
        "parent": os.getpid(),
        "path": list(path),
        "init": os.path.join(pkg, "__init__.py"),
        "dir": pkg,
        "private": private,
    }
    try:
        popen = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT, json.dumps(config)],
            pass_fds=(child.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
    finally:
        child.close()
    sock = trio.socket.from_stdlib_socket(parent)
    try:
        check_peer(sock)
        return WorkerProcess(index, popen, sock)
    except BaseException:
        sock.close()
        popen.kill()
        popen.wait()
        raise


async def stop_workers(workers: Sequence[WorkerProcess], grace: float) -> None:
    """Ask every worker to stop; kill those still running after ``grace`` seconds (the
    stop messages count against it too) and wait for them to exit. Call it shielded: it
    ends within ``grace`` plus the time SIGKILL takes, whatever was cancelled before."""
    with trio.move_on_after(grace):
        for w in workers:
            try:
                await send_message(w.sock, {"op": "stop"})
            except (PeerGone, OSError):
                pass
        for w in workers:
            await w.wait_exit()
    for w in workers:
        w.kill()
    for w in workers:
        await w.wait_exit()
