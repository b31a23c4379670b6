"""What ``fuzz.py`` throws at each socket: values of every kind msgpack can carry,
the messages made of them, the rule for the id a reply must echo, and the tally
of what came back."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgpack

# -- values of every kind msgpack can carry --------------------------------------------------


class NotUtf8:
    """Packs as a msgpack str whose bytes are not UTF-8 (what a C client may send)."""


def pack(value: Any) -> bytes:
    """msgpack of ``value``, where a ``NotUtf8`` anywhere becomes raw str bytes."""
    if isinstance(value, NotUtf8):
        return b"\xa3\xff\xfe\xfd"
    if isinstance(value, Nested):
        return b"\x91" * value.depth + b"\x90"
    if isinstance(value, dict):
        size = len(value)
        head = bytes([0x80 | size]) if size < 16 else b"\xde" + size.to_bytes(2, "big")
        return head + b"".join(pack(key) + pack(item) for key, item in value.items())
    if isinstance(value, list):
        size = len(value)
        head = bytes([0x90 | size]) if size < 16 else b"\xdc" + size.to_bytes(2, "big")
        return head + b"".join(pack(item) for item in value)
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def odd_value(rng: random.Random) -> Any:
    """A value of some type a field does not expect."""
    choices: list[Callable[[], Any]] = [
        lambda: None,
        lambda: True,
        lambda: rng.randint(-(2**63), 2**64 - 1),
        lambda: -1,
        lambda: 2**64 - 1,
        lambda: rng.random() * 10 ** rng.randint(-5, 30),
        lambda: float("nan"),
        lambda: float("inf"),
        lambda: "",
        lambda: "x" * rng.choice((1, 64, 65, 129, 5000)),
        lambda: "\x00",
        lambda: NotUtf8(),
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40))),
        lambda: [],
        lambda: [rng.randint(-5, 5) for _ in range(rng.randint(1, 6))],
        lambda: {"nested": {"deeper": [1, 2, {"x": None}]}},
        lambda: {b"bin key": 1, "str key": [{b"deeper": 2, "x": 3}]},  # keys sorted as text
        lambda: msgpack.Timestamp(1234567890),  # ext type -1
        lambda: msgpack.ExtType(rng.randint(0, 127), b"\x00" * rng.randint(0, 9)),
        lambda: _deep(rng.randint(50, 600)),
    ]
    return rng.choice(choices)()


@dataclass(frozen=True)
class Nested:
    """Packs as ``depth`` arrays, each holding the next (msgpack's nesting limit)."""

    depth: int


def _deep(depth: int) -> Any:
    return Nested(depth)


@dataclass
class Message:
    parts: list[bytes]
    request_id: int | str | None  # the id a reply must echo (None: unreadable)
    must_refuse: bool = False  # known to break the protocol: an ok reply is a bug


def echoed_id(parts: list[bytes]) -> int | str | None:
    """The id a reply must echo, by the protocol's rules (docs/PROTOCOL.md): the
    header (after an empty REQ delimiter frame) must decode as a msgpack map with
    string keys and valid UTF-8, and its ``id`` be an int in [0, 2**64) or a
    string of 1..128 characters; anything else is answered with ``id: null``."""
    frames = parts[1:] if parts and parts[0] == b"" and len(parts) > 1 else parts
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    except Exception:  # msgpack's many decode errors, UnicodeDecodeError
        return None
    value = header.get("id") if isinstance(header, dict) else None
    if isinstance(value, str) and 0 < len(value) <= 128:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        return None
    return value


class Sent(Protocol):
    """What ``exchange`` reads of a message: the id its reply must echo, and
    whether an ``ok`` reply to it would be a bug."""

    @property
    def request_id(self) -> int | str | None: ...

    @property
    def must_refuse(self) -> bool: ...


M = TypeVar("M", bound=Sent)


@dataclass
class Tally:
    """What one socket was sent and answered, replies matched to requests by id."""

    sent: int = 0
    replies: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    id_mismatches: int = 0
    unreadable_ids: int = 0
    unanswered: int = 0
    accepted_bad: int = 0
    waiting: Counter[int | str | None] = field(default_factory=Counter)
    must_refuse: set[int | str] = field(default_factory=set)

    def sent_one(self, request_id: int | str | None, must_refuse: bool) -> None:
        """A message sent whose reply must echo ``request_id`` (and, ``must_refuse``,
        must not be ``ok``)."""
        self.sent += 1
        self.waiting[request_id] += 1
        if must_refuse and request_id is not None:
            self.must_refuse.add(request_id)

    def replied(self, header_bytes: bytes) -> None:
        """Count a reply's header: its code, and whether its id was one still waited for."""
        self.replies += 1
        header = msgpack.unpackb(header_bytes, raw=False)
        code = "OK" if header.get("ok") else str(header.get("error", {}).get("code"))
        self.codes[code] += 1
        reply_id = header.get("id")
        if reply_id is None:
            self.unreadable_ids += 1
        elif header.get("ok") and reply_id in self.must_refuse:
            self.accepted_bad += 1
        if self.waiting[reply_id] > 0:
            self.waiting[reply_id] -= 1
        else:
            self.id_mismatches += 1

    def end(self) -> None:
        """What is still waited for now was never answered."""
        self.unanswered = sum(self.waiting.values())


def exchange(
    tally: Tally,
    messages: Iterator[M],
    send: Callable[[M], None],
    receive: Callable[[float], bytes | None],
    *,
    window: int,
    timeout_s: float,
) -> None:
    """Send every message (each with its ``request_id`` and ``must_refuse``) with
    at most ``window`` unanswered, and count each reply in ``tally``.
    ``receive(wait_s)`` returns a reply's header, None when none came within
    ``wait_s``, or ``b""`` when the peer closed; what is unanswered after
    ``timeout_s`` without a reply, or at the close, stays unanswered."""
    in_flight, exhausted, last_reply = 0, False, time.monotonic()
    while not exhausted or in_flight:
        while not exhausted and in_flight < window:
            message = next(messages, None)
            if message is None:
                exhausted = True
                break
            send(message)
            tally.sent_one(message.request_id, message.must_refuse)
            in_flight += 1
        header = receive(0.1)
        if header is None:
            if time.monotonic() - last_reply > timeout_s:
                break
            continue
        if not header:
            break
        last_reply = time.monotonic()
        in_flight -= 1
        tally.replied(header)
    tally.end()
