"""Waiting for Ray from trio: an ObjectRef's value, woken by Ray's own callback.

Theory of operation
-------------------
``ref.future()`` gives a ``concurrent.futures.Future`` that Ray completes on one of its
own threads (it fetches and deserializes the value there). Its done-callback hands one
``Event.set`` to the trio loop with ``TrioToken.run_sync_soon`` -- which works the same
in a plain trio run and in hcqa's trio guest run on an asyncio loop -- so a waiting task
sleeps until Ray says the object is there: no polling, no thread of ours. A cancelled
waiter just stops waiting; the late callback sets an event nobody waits on (or, after
the run ended, is dropped).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import trio

__all__ = ["resolve"]


async def resolve(ref: Any) -> Any:
    """The value of the ObjectRef ``ref`` (Ray's error for it is raised as it is)."""
    token = trio.lowlevel.current_trio_token()
    event = trio.Event()
    future: concurrent.futures.Future[Any] = ref.future()

    def done(_: concurrent.futures.Future[Any]) -> None:
        try:
            token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    future.add_done_callback(done)
    await event.wait()
    return future.result()
