"""The machinery behind :mod:`hcqa.signals` (private; users import ``hcqa.signals``).

A :class:`~hcqa.signals.Signal` is a 64-bit slot in shared memory plus an eventfd. What
makes waiting on one cheap lives here, bottom up:

* ``slots.py`` -- the pages of slots (memfd-backed, so other processes can map them);
* ``waiters.py`` -- one waiting trio task, asyncio task or thread, and how it is woken;
* ``rereader.py`` -- the per-run timer that re-reads owned signals whose producers write
  only memory, and times hang limits;
* ``aio_wait.py`` -- the same waits for an asyncio caller (no trio hop);
* ``parking.py`` -- the parking lot, a mixin of ``Signal``: one owner sleeps on the
  eventfd and hands the wake-up to everyone parked behind it;
* ``fence.py`` -- a signal and a value: what every enqueue returns.

Nothing here knows a queue, a device or a command.
"""
