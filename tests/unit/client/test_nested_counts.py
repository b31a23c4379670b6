"""msgpack counts are bounded before they are allocated (``protocol.MAX_ARRAY_ITEMS``).

msgpack-python allocates an array's item pointers when it reads the array's
count, before its items, and ``unpackb`` bounds each count only by the message's
length: 1,000 nested counts of 65,535 in a 64 KiB header, followed by zeros, made
one decode allocate 77 MiB (82 MB peak RSS) before it failed.  Request headers
on the daemon, replies and events on the client went through such a decode."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from inferd.bus.codec import Limits, decode_header
from inferd.config.ceilings import MAX_FRAMES, MAX_HEADER_FRAME_BYTES
from inferd_client import EventSubscriber, MalformedReply
from inferd_wire import protocol
from inferd_wire.protocol import MAX_ARRAY_ITEMS, MAX_HEADER_BYTES, ProtocolError
from inferd_wire.regions import MAX_REGION_TENSORS
from tests.conftest import HANG_S

#: What a decode may allocate at most here: far below the 77 MiB of the hostile
#: message unbounded, far above what refusing it at its first count takes.
MOST_TRACED_BYTES = 1 << 20


def nested_counts(count: int, depth: int, size: int) -> bytes:
    """``depth`` nested arrays of ``count`` items each (array16), then zeros: a
    message of ``size`` bytes far too short for what it counts."""
    head = (b"\xdc" + count.to_bytes(2, "big")) * depth
    return head + bytes(size - len(head))


HOSTILE = nested_counts(65535, 1000, MAX_HEADER_BYTES)


@pytest.fixture
def traced() -> Iterator[Callable[[], int]]:
    """``traced()``: the most bytes Python allocated at once since the test began."""
    tracemalloc.start()
    try:
        yield lambda: tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_header_counting_more_than_the_bound_is_refused_before_it_is_allocated(
    traced: Callable[[], int],
) -> None:
    with pytest.raises(ProtocolError) as refused:
        protocol.unpack_header(HOSTILE)
    assert traced() < MOST_TRACED_BYTES
    assert "not valid msgpack: 65535 exceeds max_array_len(2048)" in refused.value.message


def test_the_daemon_refuses_such_a_request_header_clearly_and_cheaply(
    traced: Callable[[], int],
) -> None:
    """Through its own decoder (typed first, then ``unpack_header``), at the
    ceiling of ``bus.max_header_bytes``."""
    limits = Limits(
        max_message_bytes=1 << 20, max_header_bytes=MAX_HEADER_FRAME_BYTES, max_frames=64
    )
    with pytest.raises(ProtocolError) as refused:
        decode_header(nested_counts(65535, 1000, limits.max_header_bytes), limits, typed=True)
    assert traced() < MOST_TRACED_BYTES
    assert refused.value.code == protocol.Code.INVALID_ARGUMENT
    assert "65535 exceeds max_array_len(2048)" in refused.value.message
    with pytest.raises(ProtocolError, match="nests arrays and maps more than 1024 deep"):
        decode_header(b"\x91" * 5000 + b"\x00", limits, typed=True)


def test_the_bound_holds_every_array_of_a_valid_request() -> None:
    """A request's ``inputs``: ``bus.max_frames`` at its ceiling, plus the tensors
    that live in regions."""
    assert MAX_FRAMES + MAX_REGION_TENSORS <= MAX_ARRAY_ITEMS
    inputs = [{"name": f"i{n}", "dtype": "uint8", "shape": [1]} for n in range(MAX_ARRAY_ITEMS)]
    header = {"v": 1, "id": 1, "op": "infer", "model": "m", "inputs": inputs}
    assert len(protocol.unpack_header(protocol.pack(header))["inputs"]) == MAX_ARRAY_ITEMS


@pytest.mark.parametrize(
    ("payload", "refusal"),
    [
        (HOSTILE, "65535 exceeds max_array_len"),
        (protocol.pack({"x": "x" * MAX_HEADER_BYTES}), "bytes; the limit is 65536"),
    ],
    ids=["nested-counts", "over-the-bound"],
)
def test_an_event_is_bounded_as_a_reply_header(
    tmp_path: Path, traced: Callable[[], int], payload: bytes, refusal: str
) -> None:
    endpoint = f"ipc://{tmp_path}/events.sock"
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(endpoint)
    try:
        with EventSubscriber(endpoint) as subscriber:
            give_up_at = time.monotonic() + HANG_S
            with pytest.raises(MalformedReply) as refused:  # sent until it joined
                while time.monotonic() < give_up_at:
                    publisher.send_multipart([b"health", payload])
                    subscriber.receive(timeout=0.05)
    finally:
        publisher.close(linger=0)
    assert traced() < MOST_TRACED_BYTES
    assert refusal in str(refused.value)
