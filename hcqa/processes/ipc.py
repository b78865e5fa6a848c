"""Sharing signals and buffers with another process: fds over a Unix socket.

Theory of operation
-------------------
Nothing is shared by name. A signal lives in a memfd page and wakes through an
eventfd; a shared buffer is a memfd. A process can reach them only if it is
*handed the fds*: :func:`send_message` sends a small JSON header with the fds
attached as ``SCM_RIGHTS`` ancillary data, and :func:`recv_message` receives
both. The receiving side checks the peer's credentials (``SO_PEERCRED``: same
user by default) before it trusts anything.

Signals need one more step, because an eventfd read consumes it: every process
sleeps on *its own* eventfd. When a signal is shared, each side sends the
other the eventfd of its own copy, and each copy adds the other's as a *peer*
(:meth:`Signal.add_peer`): a value written on either side wakes both. Waiters in
every process sleep; none spins.

Framing: ``!I`` length, then that many bytes of UTF-8 JSON; the fds ride on the
first byte. A closed socket raises :class:`PeerGone`.

The coordinator of a process pipeline (``hcqa.processes``) and its workers speak this
protocol over one socketpair per worker; :class:`PeerGone` never leaves the package: the
pipeline turns it into a :class:`~hcqa.errors.DeviceFault` naming the worker.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import trio

from hcqa.errors import HcqaError
from hcqa.signals import Signal

__all__ = [
    "PeerGone",
    "attach_signal",
    "check_peer",
    "offer_signal",
    "recv_message",
    "send_message",
]

MAX_FDS = 253  # the kernel's SCM_MAX_FD
_LEN = struct.Struct("!I")


class PeerGone(HcqaError):
    """The other process closed its end of the socket (it exited or died)."""


async def send_message(
    sock: trio.socket.SocketType, header: dict[str, Any], fds: Sequence[int] = ()
) -> None:
    """Send ``header`` (JSON) with ``fds`` attached."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} fds per message (got {len(fds)})")
    body = json.dumps(header).encode()
    frame = _LEN.pack(len(body)) + body
    ancillary = []
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    try:
        sent = await sock.sendmsg([frame], ancillary)
        while sent < len(frame):
            sent += await sock.send(frame[sent:])
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerGone(f"the peer closed the socket ({exc.strerror})") from exc


async def _recv_exactly(sock: trio.socket.SocketType, n: int) -> bytes:
    chunks = []
    while n:
        data = await sock.recv(n)
        if not data:
            raise PeerGone("the peer closed the socket mid-message")
        chunks.append(data)
        n -= len(data)
    return b"".join(chunks)


async def recv_message(sock: trio.socket.SocketType) -> tuple[dict[str, Any], list[int]]:
    """Receive one header and its fds (the caller owns the fds)."""
    try:
        data, ancdata, _flags, _addr = await sock.recvmsg(_LEN.size, socket.CMSG_SPACE(MAX_FDS * 4))
    except ConnectionResetError as exc:
        raise PeerGone("the peer reset the socket") from exc
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    if not data:
        for fd in fds:
            os.close(fd)
        raise PeerGone("the peer closed the socket")
    try:
        if len(data) < _LEN.size:
            data += await _recv_exactly(sock, _LEN.size - len(data))
        (length,) = _LEN.unpack(data)
        header = json.loads(await _recv_exactly(sock, length))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return header, fds


def check_peer(sock: trio.socket.SocketType, *, uid: int | None = None) -> int:
    """The peer's pid, after checking it runs as ``uid`` (default: our own user)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, peer_uid, _gid = struct.unpack("3i", raw)
    want = os.getuid() if uid is None else uid
    if peer_uid != want:
        raise PermissionError(f"peer process {pid} must run as uid {want} (got uid {peer_uid})")
    return int(pid)


def offer_signal(sig: Signal) -> tuple[dict[str, Any], list[int]]:
    """Header fields and fds that let another process attach to ``sig``."""
    page_fd, index, event_fd = sig.export()
    return {"index": index, "name": sig.name}, [page_fd, event_fd]


def attach_signal(meta: dict[str, Any], fds: Sequence[int]) -> Signal:
    """The receiving side of :func:`offer_signal` (takes ownership of both fds).

    The new signal's own eventfd must be sent back and given to the original's
    ``add_peer`` so that values written on the original wake waiters here."""
    page_fd, peer_fd = fds
    sig = Signal.attach(page_fd, int(meta["index"]), name=str(meta["name"]))
    sig.add_peer(peer_fd)
    return sig
