"""What a request header may ask of its own reply: a deadline (``deadline_ms``)
and a bound on each reply frame (``max_reply_frame_bytes``).

Read from a typed header (``bus.headers``, which has checked their types and
ranges) or from the dict the reference checks read, checked here with the
protocol's messages.  Both are read at admission, so a bad value is refused
before the request is queued and changes nothing.
"""

from __future__ import annotations

import math

from msgspec import UNSET

from inferd.bus.headers import MAX_REPLY_FRAME_BOUND, Header, InferHeader
from inferd.config.sections import MAX_DEADLINE_MS
from inferd_wire.protocol import Code, ProtocolError


def deadline_ms_of(header: Header, default_ms: int) -> int:
    """The request's deadline in ms (0 = none); ``default_ms`` when absent.  A
    fraction is rounded up (1.9 is 2 ms): never shorter than the client asked."""
    if isinstance(header, InferHeader):
        typed = header.deadline_ms
        if typed is None or typed is UNSET:
            return default_ms
        return math.ceil(typed)  # > 0 (bus.headers): at least 1
    value = header.get("deadline_ms")
    if value is None:
        return default_ms
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(Code.INVALID_ARGUMENT, "'deadline_ms' must be a number")
    if not 0 < value <= MAX_DEADLINE_MS:
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"'deadline_ms' must be in (0, {MAX_DEADLINE_MS}], got {value}"
        )
    return math.ceil(value)


def reply_frame_bound_of(header: Header) -> int | None:
    """The most bytes the client takes in one reply frame (None: no bound).  A
    client that bounds its socket's frames (``ZMQ_MAXMSGSIZE``) says so, and a
    reply that would not fit is answered ``RESOURCE_EXHAUSTED`` instead of being
    sent to end its connection unread (``serving/reply_tensors.oversized_frame``)."""
    if isinstance(header, InferHeader):
        typed = header.max_reply_frame_bytes
        return None if typed is UNSET else typed
    value = header.get("max_reply_frame_bytes")
    if value is None:
        return None
    bound = MAX_REPLY_FRAME_BOUND
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= bound:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"'max_reply_frame_bytes' must be an integer in [1, {MAX_REPLY_FRAME_BOUND}], "
            f"got {value!r}",
        )
    return value
