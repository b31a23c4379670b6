"""Lean multipart send/receive for the request path.

pyzmq's ``recv_multipart(copy=False)`` asks ``getsockopt(RCVMORE)`` after
every part and ``send_multipart`` walks the parts once more to type-check them
before sending; on the request path (the client's two and the daemon's three multipart
messages per request) that Python-level overhead is measurable next to the transport
itself (bench/rtt.py, bench/README.md).  These helpers do the same socket
operations with ``copy=False`` semantics: a received frame knows whether more
parts follow, and the parts both sides send are always ``bytes``,
``zmq.Frame`` or contiguous numpy arrays.
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


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message is waiting (``ZMQ_EVENTS``): cheaper than a NOBLOCK recv
    that ends in ``zmq.Again``."""
    return bool(cast(int, sock.get(_EVENTS)) & _POLLIN)


def recv_frames(sock: zmq.Socket[Any], flags: int = 0) -> list[zmq.Frame]:
    """``sock.recv_multipart(flags, copy=False)``: every part of one message as a Frame.

    Raises ``zmq.Again`` (with NOBLOCK) before anything is consumed when no
    message is waiting; ZeroMQ delivers the parts of a message atomically, so
    the remaining parts are always there once the first one arrived.
    """
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


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
