"""Fault injection and leak checks for tests of code built on hcqa.

Import it explicitly (``import hcqa.testing``); nothing here is re-exported by ``hcqa``.
Every helper works on an open device and goes through the same paths real faults take, so
your code sees exactly what it would see in production:

========================================  ==========================================================
helper                                    what happens
========================================  ==========================================================
``failing_kernel(dev, exc)``              a program whose runs raise ``exc`` in the engine thread:
                                          awaiting its fence raises :class:`~hcqa.DeviceFault`
                                          (``__cause__`` is ``exc``); the device stays faulted
``hanging_kernel(dev)``                   ``(program, gate)``: runs block until ``gate.release()``;
                                          awaiting them raises :class:`~hcqa.SignalTimeout` after
                                          one to two hang limits and marks the device hung
``fail_next_copy(dev, exc)``              the next copy on the device's copy queue (``copyin``,
                                          ``copyout``, ``Queue.copy``, a transfer *into* the
                                          device) raises ``exc``: a ``DeviceFault`` on ``"copy"``
``fail_next_load(dev, exc)``              the same for ``Buffer.load``
``kill_engine(dev, "compute")``           the queue's engine thread dies (an exception escapes its
                                          loop, outside any handler): the device faults with
                                          ``engine thread ... died``
``Resources.now()``                       open fds, threads and RSS of this process, for leak checks
``parked_waiters(dev_or_signal, ...)``    tasks and threads parked on the signals of devices /
                                          signals: 0 once nobody waits
========================================  ==========================================================

A device that faulted or hung does not recover: leave its ``open_device`` block and open it again
(see ``docs/reliability.md``). A held :class:`Gate` keeps its engine thread busy, so release it (or
use it as a context manager) before the test ends; a gate that is never released lets its runs go
after ``max_hold`` seconds, failing them, so a forgotten gate can't hold a thread forever.

The helpers live in ``faults.py`` (the injections) and ``leaks.py`` (resources and parked
waiters); this package re-exports them.

Example::

    import hcqa, hcqa.testing as ht

    async def test_my_server_survives_a_bad_kernel():
        async with hcqa.open_device("cpu:0", hang_limit=1.0) as dev:
            buf = dev.alloc(64)
            with pytest.raises(hcqa.DeviceFault) as info:
                await ht.failing_kernel(dev, ValueError("boom"))(buf)
            assert isinstance(info.value.__cause__, ValueError)
"""

from hcqa.testing.faults import (
    EngineKilled,
    Gate,
    InjectedFault,
    Injection,
    fail_next_copy,
    fail_next_load,
    failing_kernel,
    hanging_kernel,
    kill_engine,
)
from hcqa.testing.leaks import Resources, parked_waiters

__all__ = [
    "EngineKilled",
    "Gate",
    "InjectedFault",
    "Injection",
    "Resources",
    "fail_next_copy",
    "fail_next_load",
    "failing_kernel",
    "hanging_kernel",
    "kill_engine",
    "parked_waiters",
]
