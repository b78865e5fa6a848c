"""Host copies and file loads: a device's ``copyin``, ``copyout`` and ``load``.

Theory of operation
-------------------
``buf.copyin(a)``, ``buf.copyout(b)`` and ``buf.load(path)`` come here (``buffer.py`` calls
the device). Each checks its arguments on the caller's task -- the host array's size and
layout (``host_ref``), the file's kind and size, opened once now so that a file the engine
could not read is refused here -- and submits one ``Copy`` or ``Load`` on the copy queue
(a copy-out, or a copy-in, may run on the compute queue, see ``_copyout_queue``) through
``Device._submit``, with the buffer's hazard.

This is a mixin of :class:`~hcqa.devices.base.Device`, which sets the attributes declared
below.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hcqa import commands as cmd
from hcqa.devices.buffer import Buffer
from hcqa.devices.hostarrays import host_ref
from hcqa.devices.sizes import check_size
from hcqa.errors import InvalidCommand
from hcqa.signals import Fence

if TYPE_CHECKING:
    from hcqa.actors import QueueActor

__all__ = ["HostCopies"]

_copy_command = cmd.maker(cmd.Copy)  # (dest, src, nbytes, native): a host copy's command


class HostCopies:
    """A device's host copies and loads (see the module doc)."""

    compute: QueueActor
    copy: QueueActor
    _submit: Callable[..., Fence]

    def _copyin(self, buf: Buffer, src: Any, *, on_compute: bool = False) -> Fence:
        """``on_compute``: as for :meth:`_copyout`."""
        buf._check()
        host = host_ref(src, buf, writable=False)
        command = _copy_command(buf, host, buf.nbytes, None)
        queue = self._copyout_queue(on_compute)
        return self._submit(queue, [command], writes=[buf], waits=False)

    def _copyout(self, buf: Buffer, dest: Any, *, on_compute: bool = False) -> Fence:
        """``on_compute``: on the compute queue where it takes host copies (see
        ``_copyout_queue``), else on the copy queue."""
        buf._check()
        host = host_ref(dest, buf, writable=True)
        command = _copy_command(host, buf, buf.nbytes, None)
        queue = self._copyout_queue(on_compute)
        return self._submit(queue, [command], reads=[buf], waits=False)

    def _copyout_queue(self, on_compute: bool) -> QueueActor:
        """The queue a host copy (out or in) runs on: the compute queue when asked for and
        ``_copies_on_compute``, else the copy queue."""
        return self.compute if on_compute and self._copies_on_compute() else self.copy

    def _copies_on_compute(self) -> bool:
        """Whether the compute queue's executor also runs host copies (``Copy`` commands
        between a buffer and a host array). A pipeline then copies its last stage's output
        out right behind the kernel on that queue, instead of on the copy engine, where it
        would wait behind the next microbatch's incoming transfer (``hcqa/pipeline.py``);
        a model's graph copies in and out there too, so a replay is one queue's batch that
        the engine runs right behind the one before, no Wait on the event loop between
        (``hcqa/models/model.py``)."""
        return False

    def _load(self, buf: Buffer, path: str, offset: int, nbytes: int | None) -> Fence:
        buf._check()
        offset = check_size("offset", offset)
        n = buf.nbytes if nbytes is None else check_size("nbytes", nbytes, minimum=1)
        if n > buf.nbytes:
            raise InvalidCommand(f"'nbytes' must be <= the buffer's {buf.nbytes} bytes (got {n})")
        try:  # opened now, so a file the engine could not read is refused here
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise InvalidCommand(
                f"load: {path!r} must be a readable file (got: {exc.strerror})"
            ) from exc
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidCommand(f"load: {path!r} must be a regular file (got {_file_kind(st)})")
        size = st.st_size
        if offset + n > size:
            raise InvalidCommand(
                f"load: {path!r} must hold offset + nbytes = {offset + n} bytes (got {size})"
            )
        command = cmd.Load(dest=buf, path=path, offset=offset, nbytes=n)
        return self._submit(self.copy, [command], writes=[buf])


def _file_kind(st: os.stat_result) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(st.st_mode):
            return kind
    return "not a regular file"
