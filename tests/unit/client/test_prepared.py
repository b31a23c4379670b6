"""Headers packed once but for their id, and replies' outputs parsed once
(``inferd_client.prepared``, DESIGN.md 115): the bytes are the full encoding's,
and nothing a reply or a call may change is taken from an earlier one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from inferd_client.client import infer_request_header
from inferd_client.errors import MalformedReply
from inferd_client.prepared import FramesRequest, PreparedHeader, frames_key, parse_outputs
from inferd_wire import protocol

DESCRIPTOR = {"name": "x", "dtype": "float32", "shape": [1, 3, 4, 4]}


@pytest.mark.parametrize("keys", [0, 3, 14, 15, 16, 40])
@pytest.mark.parametrize("request_id", [0, 127, 128, 2**16, 2**40 + 7, 2**64 - 1])
def test_a_prepared_header_is_its_header_packed_id_last(keys: int, request_id: int) -> None:
    # 15 keys and the id are 16 entries: the map's opening byte grows (map16).
    header = {f"k{index}": index for index in range(keys)}
    assert PreparedHeader(header).encode(request_id) == protocol.pack({**header, "id": request_id})


def test_an_infer_header_is_prepared_byte_for_byte() -> None:
    for deadline_ms in (None, 25):
        header = infer_request_header("m", [DESCRIPTOR], [], deadline_ms)
        prepared = PreparedHeader(header)
        for request_id in (1, 2**40 + 7):
            assert prepared.encode(request_id) == protocol.pack({**header, "id": request_id})


def test_a_header_that_has_an_id_is_refused() -> None:
    with pytest.raises(ValueError, match="without its id"):
        PreparedHeader({"v": 1, "id": 3})


def test_the_frames_key_tells_apart_what_the_header_is_made_of() -> None:
    x = np.zeros((2, 3), np.float32)
    key = frames_key("m", None, {"x": x})
    assert key == frames_key("m", None, {"x": np.ones((2, 3), np.float32)})  # other values
    assert key != frames_key("other", None, {"x": x})
    assert key != frames_key("m", 25, {"x": x})
    assert key != frames_key("m", None, {"y": x})
    assert key != frames_key("m", None, {"x": x.reshape(3, 2)})
    assert key != frames_key("m", None, {"x": x.astype(np.float16)})
    assert key != frames_key("m", None, {"x": x, "z": x})
    assert frames_key("m", None, {}) == ("m", None, ())
    # What the wire cannot take as it is goes the full way, which copies it.
    assert frames_key("m", None, {"x": np.zeros((3, 2), np.float32).T}) is None
    assert frames_key("m", None, {"x": x.astype(">f4")}) is None
    assert frames_key("m", None, {"x": [1.0, 2.0]}) is None


def reply(*descriptors: Any) -> dict[str, Any]:
    return {"outputs": list(descriptors)}


def test_a_reply_with_the_outputs_of_the_last_reuses_their_parsing() -> None:
    request = FramesRequest(infer_request_header("m", [DESCRIPTOR], [], None))
    first = request.outputs_of(reply(dict(DESCRIPTOR)))
    assert first == parse_outputs([DESCRIPTOR])
    again = request.outputs_of(reply(dict(DESCRIPTOR)))
    assert again is first
    other = request.outputs_of(reply({**DESCRIPTOR, "shape": [2, 3, 4, 4]}))
    assert other is not first and other[0][2] == (2, 3, 4, 4)


def test_a_reply_changed_by_its_reader_does_not_change_what_was_parsed() -> None:
    request = FramesRequest(infer_request_header("m", [DESCRIPTOR], [], None))
    kept = reply(dict(DESCRIPTOR))
    request.outputs_of(kept)
    kept["outputs"][0]["shape"] = [48]  # the caller's last_reply, changed in place
    parsed = request.outputs_of(reply({**DESCRIPTOR, "shape": [48]}))
    assert parsed[0][2] == (48,)
    assert request.outputs_of(reply(dict(DESCRIPTOR)))[0][2] == (1, 3, 4, 4)


@pytest.mark.parametrize(
    "outputs",
    [None, {}, [{"name": "x", "dtype": "complex64", "shape": [1]}], [{"name": "x", "shape": [1]}]],
)
def test_a_malformed_reply_is_refused_however_many_good_ones_came_before(outputs: Any) -> None:
    request = FramesRequest(infer_request_header("m", [DESCRIPTOR], [], None))
    with pytest.raises(MalformedReply):
        request.outputs_of({"outputs": outputs})  # the first reply
    good = request.outputs_of(reply(dict(DESCRIPTOR)))
    with pytest.raises(MalformedReply):
        request.outputs_of({"outputs": outputs})
    assert request.outputs_of(reply(dict(DESCRIPTOR))) is good  # the refusal changed nothing
    with pytest.raises(MalformedReply):
        request.outputs_of({})  # no outputs at all


@pytest.mark.parametrize("shape", [[1.0, 3, 4, 4], [True, 3, 4, 4]])
def test_a_reply_equal_to_the_last_only_by_python_equality_is_refused(shape: list[Any]) -> None:
    """4.0 == 4 and True == 1 in Python: compared that way, a reply the checks refuse
    would pass once a good one came, and strictness would depend on history."""
    request = FramesRequest(infer_request_header("m", [DESCRIPTOR], [], None))
    request.outputs_of(reply(dict(DESCRIPTOR)))
    with pytest.raises(MalformedReply, match="non-negative integers"):
        request.outputs_of(reply({**DESCRIPTOR, "shape": shape}))
