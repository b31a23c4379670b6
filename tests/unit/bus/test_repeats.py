"""A message split at its trailing id (``bus.repeats``, DESIGN.md 109): exactly the
headers that end with ``"id"`` and an unsigned int, in each msgpack width."""

from __future__ import annotations

import struct

import msgpack
import pytest

from inferd.bus.headers import decode_infer
from inferd.bus.repeats import repeat_of, splits_at_id
from inferd_client.shm import ShmRequest

HEADER = {"v": 1, "op": "infer", "model": "identity", "inputs": []}
#: A float64 of about 1000 whose last four bytes are "\xa2id" and 5.
DEADLINE_ENDING_IN_ID = struct.unpack(">d", b"\x40\x8f\x40\x00\xa2\x69\x64\x05")[0]


@pytest.mark.parametrize("request_id", [0, 5, 127, 128, 255, 256, 65535, 65536, 2**32, 2**64 - 1])
def test_a_header_ending_with_its_id_splits_at_the_id_in_every_width(request_id: int) -> None:
    data = msgpack.packb({**HEADER, "id": request_id})
    repeat = repeat_of(data)
    assert repeat is not None and repeat.request_id == request_id
    assert data.startswith(repeat.prefix) and repeat.prefix.endswith(b"\xa2id")
    # Any id after the same bytes is the same header but for the id.
    other = msgpack.packb(request_id ^ 1)
    header = decode_infer(repeat.prefix + other)
    assert header is not None and header.id == request_id ^ 1 and header.model == "identity"


def test_the_clients_encoding_of_a_repeated_request_is_split_at_its_id() -> None:
    encoded = ShmRequest(HEADER, []).encode(2**63 + 7)
    repeat = repeat_of(encoded)
    assert repeat is not None and repeat.request_id == 2**63 + 7
    assert repeat_of(ShmRequest(HEADER, []).encode(2**63 + 8)) == (
        type(repeat)(repeat.prefix, 2**63 + 8)
    )


@pytest.mark.parametrize(
    "header",
    [
        {"v": 1, "id": 7, "op": "infer", "model": "identity"},  # the id is not last
        {**HEADER, "id": "a-string-id"},  # not an unsigned int
        {**HEADER, "id": -3},  # a negative int
        {**HEADER, "model": "id"},  # "id" as the last value, not a key
        {**HEADER, "id": 7, "deadline_ms": 7},  # another key last
    ],
)
def test_anything_else_is_not_split(header: dict[str, object]) -> None:
    assert repeat_of(msgpack.packb(header)) is None


def test_short_messages_are_not_split() -> None:
    for data in (b"", b"\xa2id", b"\xa2id\x05", b"\x81\xa2id"):
        assert repeat_of(data) is None


def test_a_prefix_is_the_ids_only_when_both_probes_decode_to_the_header() -> None:
    data = msgpack.packb({**HEADER, "id": 5})
    repeat = repeat_of(data)
    header = decode_infer(data)
    assert repeat is not None and header is not None and splits_at_id(repeat.prefix, header)


@pytest.mark.parametrize(
    "header",
    [
        # A float deadline whose last bytes are "id" and 5: the id (5) is elsewhere.
        {"v": 1, "id": 5, "op": "infer", "model": "m", "deadline_ms": DEADLINE_ENDING_IN_ID},
        # A model name ending with "¢id" and 5 (UTF-8 c2 a2 69 64 05).
        {"v": 1, "id": 5, "op": "infer", "model": "x\u00a2id\u0005"},
    ],
)
def test_bytes_that_only_look_like_a_trailing_id_are_not_taken_for_one(
    header: dict[str, object],
) -> None:
    data = msgpack.packb(header)
    repeat = repeat_of(data)
    decoded = decode_infer(data)
    assert repeat is not None and repeat.request_id == 5  # they do look like one
    assert decoded is not None and decoded.id == 5  # and the id matches, by design
    assert not splits_at_id(repeat.prefix, decoded)
