"""One message of a client's ``shm.sock`` connection: read with the descriptors it
brings, or its end (``read_message``), and an answer packed within the socket's
bound (``fitted``).  ``shm.connections`` holds the connections and their locks.

A message is read with room for every descriptor it may bring, since the kernel
closes those that do not fit on the reader's thread, where a close that blocks
would stop inference (DESIGN.md 120).  While too many wait to be closed, a
message bringing more than one memfd is not read at all (``unread``): each
connection could otherwise bring 253 more past the closer's bound.
"""

from __future__ import annotations

import array
import os
import select
import socket
from dataclasses import dataclass
from typing import Any

from inferd.shm.closer import DescriptorCloser
from inferd.shm.memfd import is_memfd
from inferd_wire import protocol
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES

_FD = array.array("i").itemsize
#: The most descriptors one message can carry (Linux's ``SCM_MAX_FD``): room for
#: all, so that the kernel never drops one (its last close would run on the reader).
_MAX_FDS = 253
#: ``poll``'s word for a peer that sent its last message (closed, or shut down).
_ENDED = select.POLLRDHUP | select.POLLHUP
#: What ends an error's message that ``fitted`` shortened.
_CUT = " [cut to fit the shm socket's message bound]"


@dataclass
class Message:
    """One message read from a connection: its bytes, the descriptors it carried
    (``ShmConnections.discard_fds`` has them closed) and ``recvmsg``'s flags; or,
    ``closed``, the end of the peer's input (it closed, or shut down its side);
    or, ``unread``, a message left unread because it brings descriptors while too
    many wait to be closed (``ShmConnections.leave_unread`` closes the connection)."""

    data: bytes
    fds: list[int]
    flags: int
    closed: bool = False
    unread: bool = False


def read_message(sock: socket.socket, closer: DescriptorCloser | None) -> Message | None:
    """The next message on ``sock`` (its connection's lock held), or None when none
    waits (another reader took it)."""
    if closer is not None and closer.backed_up and _brings_more_than_a_memfd(sock, closer):
        return Message(b"", [], 0, unread=True)
    try:
        data, ancillary, flags, _ = sock.recvmsg(
            MAX_SHM_MESSAGE_BYTES, socket.CMSG_SPACE(_MAX_FDS * _FD), socket.MSG_CMSG_CLOEXEC
        )
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return Message(b"", [], 0, closed=True)  # reset by the peer
    if not data and not ancillary:
        # The end of the peer's input reads as an empty message; a real one
        # (refused as such) leaves no end to see.
        return Message(b"", [], flags, closed=bool(_poll_events(sock) & _ENDED))
    return Message(data, _descriptors(ancillary), flags)


def fitted(header: dict[str, Any]) -> bytes:
    """``header`` packed within ``MAX_SHM_MESSAGE_BYTES``: an error whose message
    quotes so much of the request (a long model or op name, escaped) that it would
    not fit keeps its code and id, and its message is cut short, saying so."""
    data = protocol.pack(header)
    error = header.get("error")
    over = len(data) - MAX_SHM_MESSAGE_BYTES
    if over <= 0 or not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return data
    message = error["message"].encode()
    keep = max(0, len(message) - over - len(_CUT))  # a shorter str's prefix is no longer
    short = message[:keep].decode(errors="ignore") + _CUT
    return protocol.pack({**header, "error": {**error, "message": short}})


def hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed its end entirely (``POLLHUP``), not only its writing
    side (``shutdown(SHUT_WR)``: ``POLLRDHUP`` alone)."""
    return bool(_poll_events(sock) & select.POLLHUP)


def _poll_events(sock: socket.socket) -> int:
    """What ``poll`` says of ``sock`` now (its end, its peer's end: ``_ENDED``)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)  # POLLHUP is reported whatever is asked
    return sum(events for _, events in poller.poll(0))


def _brings_more_than_a_memfd(sock: socket.socket, closer: DescriptorCloser) -> bool:
    """Whether the next message on ``sock`` brings a descriptor other than one memfd
    (a ``register``'s).  Peeked with room for one descriptor: the kernel installs a
    copy of the first (the queued message keeps its own reference, so closing the
    copy is never the file's last close) and reports any more as ``MSG_CTRUNC``."""
    try:
        _, ancillary, flags, _ = sock.recvmsg(
            0, socket.CMSG_LEN(_FD), socket.MSG_PEEK | socket.MSG_CMSG_CLOEXEC
        )  # CMSG_LEN: CMSG_SPACE's padding would make room for a second one
    except OSError:  # nothing waits, or the receive that follows meets the error
        return False
    copies = _descriptors(ancillary)
    if len(copies) == 1 and not flags & socket.MSG_CTRUNC and is_memfd(copies[0]):
        os.close(copies[0])  # shared memory has no flush: this close never blocks
        return False
    closer.close_later(copies)  # even a copy's close may block (FUSE flushes on each)
    return bool(copies) or bool(flags & socket.MSG_CTRUNC)


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    if not ancillary:  # an infer request: no descriptor
        return []
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % _FD])
    return list(fds)
