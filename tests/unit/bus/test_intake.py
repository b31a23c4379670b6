"""The bus intake over a real ROUTER/DEALER pair: messages within the limits
come whole, oversized ones are read to their end without being kept, a bounded
share per call, and the next message on the connection is intact."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from inferd.bus.codec import Limits
from inferd.bus.intake import Intake, Oversized
from inferd.config.ceilings import MAX_HEADER_FRAME_BYTES
from inferd_wire.protocol import Code

LIMITS = Limits(max_message_bytes=1000, max_header_bytes=64, max_frames=4)
HEADER = msgpack.packb({"v": 1, "id": "r-1", "op": "infer"})


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind("inproc://intake")
    dealer = context.socket(zmq.DEALER)
    dealer.connect("inproc://intake")
    yield router, dealer
    router.close(linger=0)
    dealer.close(linger=0)
    context.term()


def receive(intake: Intake) -> list[zmq.Frame] | Oversized:
    """The next message or refusal: the socket must be readable until it comes."""
    for _ in range(10_000):
        assert intake.socket.poll(5000, zmq.POLLIN), "nothing to read"
        received = intake.receive()
        if received is not None:
            return received
    raise AssertionError("no message after 10000 calls")


def test_a_message_within_the_limits_comes_whole(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    intake = Intake(router, LIMITS)
    assert intake.receive() is None  # nothing waiting
    dealer.send_multipart([HEADER, b"a" * 250, b"b" * 250, b"c" * 250, b"d" * 250])
    frames = receive(intake)
    assert isinstance(frames, list)
    assert [len(f) for f in frames[1:]] == [len(HEADER), 250, 250, 250, 250]


def test_a_req_peer_delimiter_is_part_of_the_envelope(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    intake = Intake(router, LIMITS)
    dealer.send_multipart([b"", HEADER, *([b"x"] * 5)])
    refused = receive(intake)
    assert isinstance(refused, Oversized)
    assert refused.envelope[1:] == [b""] and refused.frames == 5
    assert refused.header is not None and refused.header.bytes == HEADER


def test_too_many_frames_are_counted_to_the_end_and_let_go_in_bounded_calls(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    intake = Intake(router, LIMITS, frames_per_call=100)
    dealer.send_multipart([HEADER, *([b"x"] * 1000)])
    dealer.send_multipart([HEADER, b"next"])
    calls = 0
    while (received := intake.receive()) is None:
        calls += 1
        assert router.poll(0, zmq.POLLIN), "mid-message, the socket stays readable"
    assert calls >= 9, calls  # 1000 frames, at most 100 per call
    assert isinstance(received, Oversized)
    assert (received.frames, received.nbytes) == (1000, 1000)
    assert received.header is not None and received.header.bytes == HEADER
    error = received.error(LIMITS)
    assert error.code is Code.INVALID_ARGUMENT
    assert error.message == "message carries 1000 tensor frames; the limit is 4"
    following = receive(intake)
    assert isinstance(following, list) and following[-1].bytes == b"next"


def test_too_many_bytes_are_refused_with_the_whole_size(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    intake = Intake(router, LIMITS)
    dealer.send_multipart([HEADER, b"a" * 600, b"b" * 600, b"c" * 600])
    refused = receive(intake)
    assert isinstance(refused, Oversized)
    assert (refused.frames, refused.nbytes) == (3, 1800)
    assert refused.error(LIMITS).message == "tensor frames hold 1800 bytes; the limit is 1000"


def test_the_frame_that_crosses_the_limit_may_be_the_last(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    intake = Intake(router, LIMITS)
    dealer.send_multipart([HEADER, b"a" * 1001])
    refused = receive(intake)
    assert isinstance(refused, Oversized) and refused.complete
    assert (refused.frames, refused.nbytes) == (1, 1001)
    dealer.send_multipart([HEADER])
    assert isinstance(receive(intake), list)


def test_a_header_past_any_configurable_limit_is_not_kept(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    intake = Intake(router, LIMITS)
    dealer.send_multipart([b"h" * (MAX_HEADER_FRAME_BYTES + 1), *([b""] * 5)])
    refused = receive(intake)
    assert isinstance(refused, Oversized) and refused.header is None
    assert (refused.frames, refused.nbytes) == (5, 0)
    assert refused.reply(LIMITS).header["id"] is None


def test_a_header_over_max_header_bytes_gives_the_refusal_its_id(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    """Refused for its frames, with a header also past ``max_header_bytes``: the
    refusal carries the id read alone (``id_of_oversized``, DESIGN.md 207), so the
    client fails at once instead of waiting out its timeout."""
    router, dealer = pair
    intake = Intake(router, LIMITS)
    long_header = msgpack.packb({"v": 1, "op": "infer", "model": "m" * 100, "id": "r-9"})
    assert len(long_header) > LIMITS.max_header_bytes
    dealer.send_multipart([long_header, *([b""] * 5)])
    refused = receive(intake)
    assert isinstance(refused, Oversized)
    reply = refused.reply(LIMITS).header
    assert reply["id"] == "r-9" and reply["error"]["code"] == Code.INVALID_ARGUMENT
    assert reply["error"]["message"] == "message carries 5 tensor frames; the limit is 4"
