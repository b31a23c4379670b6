"""Lean multipart send/receive for the request path.

pyzmq's ``recv_multipart(copy=False)`` asks ``getsockopt(RCVMORE)`` after
every part and ``send_multipart`` walks the parts once more to type-check them
before sending; on the request path (the client's two and the daemon's three multipart
messages per request) that Python-level overhead is measurable next to the transport
itself (bench/rtt.py, bench/README.md).  These helpers do the same socket
operations with ``copy=False`` semantics: a received frame knows whether more
parts follow, and the parts both sides send are always ``bytes``,
``zmq.Frame`` or contiguous numpy arrays.

A read cut short between the parts of a message (an exception a signal handler
raised, ``KeyboardInterrupt``) leaves the rest of that message in the socket;
``recv_frames`` notes it in the socket's ``ReadState`` and discards that rest
before its next read, so a tensor frame is never taken for a header.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import zmq

# Plain ints: ``int & zmq.POLLIN`` or ``int | zmq.SNDMORE`` goes through
# ``enum.Flag`` (a few us a call).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message is waiting (``ZMQ_EVENTS``): cheaper than a NOBLOCK recv
    that ends in ``zmq.Again``."""
    return bool(cast(int, sock.get(_EVENTS)) & _POLLIN)


class ReadState:
    """One socket's note that a ``recv_frames`` on it began and has not returned.

    Python runs signal handlers between bytecodes: an exception one raises
    (``KeyboardInterrupt``, a watchdog's) after the first part of a message was
    read leaves the rest in the socket, and the next read took a tensor frame
    for the reply's header (``MalformedReply``; 77 of 200 interrupted infer
    calls, third review of the client).  Set before the first part is read and
    cleared once the last one was: the normal path costs two stores and a test,
    no system call; only the read after one cut short asks ``RCVMORE``.  One per
    socket, made with it (a socket made anew starts in step)."""

    __slots__ = ("unfinished",)

    def __init__(self) -> None:
        self.unfinished = False


def recv_frames(sock: zmq.Socket[Any], flags: int = 0, *, state: ReadState) -> list[zmq.Frame]:
    """``sock.recv_multipart(flags, copy=False)``: every part of one message as a Frame,
    after the rest of a message a read cut short left (``ReadState``).

    Raises ``zmq.Again`` (with NOBLOCK) before anything is consumed when no
    message is waiting, the rest of one cut short aside (what a caller that saw
    the socket readable then gets: it waits again); ZeroMQ delivers the parts of
    a message atomically, so the remaining parts are always there once the first
    one arrived.
    """
    if state.unfinished:
        discard_rest(sock)
    state.unfinished = True
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    state.unfinished = False
    return frames


def recv_parts(sock: zmq.Socket[Any], flags: int = 0, *, state: ReadState) -> list[bytes]:
    """``sock.recv_multipart(flags)``, copied into ``bytes``, after the rest of a
    message a read cut short left (``ReadState``), as ``recv_frames``.

    For small messages (events): no ``zmq.Frame`` outlives the call.  pyzmq's
    ``Frame.__dealloc__`` runs pending signal handlers and drops what they raise
    ("Exception ignored in Frame.__dealloc__"): a Ctrl-C landing there is lost.
    """
    if state.unfinished:
        discard_rest(sock)
    state.unfinished = True
    parts: list[bytes] = sock.recv_multipart(flags)
    state.unfinished = False
    return parts


def discard_rest(sock: zmq.Socket[Any]) -> None:
    """Read and drop the parts left of a message whose first parts were read
    (``RCVMORE``; none after a whole message).  They are all there (ZeroMQ
    delivers a message whole), so it never waits.  Copied, not kept as
    ``zmq.Frame`` (see ``recv_parts``): a rare path."""
    while sock.get(_RCVMORE):
        try:
            sock.recv(_NOBLOCK)
        except zmq.Again:  # never expected; no spinning on RCVMORE if it happens
            return


def send_frames(sock: zmq.Socket[Any], parts: Sequence[Any], flags: int = 0) -> None:
    """``sock.send_multipart(parts, flags, copy=False)``.

    Parts under pyzmq's copy threshold are copied, larger ones are sent
    zero-copy.  ZeroMQ queues a multipart message atomically: a refusal
    (EAGAIN, EHOSTUNREACH) can only happen on the first part.  Unlike
    ``send_multipart`` nothing is type-checked up front, so every part must
    support the buffer protocol (a later part that does not would leave a
    partial message queued on the socket).
    """
    last = len(parts) - 1
    more = int(flags) | _SNDMORE
    for index, part in enumerate(parts):
        sock.send(part, more if index < last else flags, copy=False)
