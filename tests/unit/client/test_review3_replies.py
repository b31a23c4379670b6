"""A reply's empty output whose other dimensions multiply past what numpy can
address (third review of the Python client): ``MalformedReply``, not numpy's
``ValueError`` (``protocol.frame_to_array``, which the daemon's codec shares)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd_client import InferenceClient, MalformedReply
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError
from tests.unit.client.scripted import Script, ok_reply

#: Zero elements, so the empty frame has the right length; but 15 dimensions of
#: 2**31 - 1 overflow numpy's size even so.
HUGE_EMPTY = [0] + [2**31 - 1] * 15


def test_an_empty_tensor_of_unaddressable_dimensions_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError) as caught:
        protocol.frame_to_array("y", protocol.WIRE_DTYPES["float32"], HUGE_EMPTY, b"")
    assert caught.value.code is Code.INVALID_ARGUMENT
    assert "too large" in caught.value.message


def test_a_reply_with_such_an_output_is_a_malformed_reply(
    server: Callable[[Script], str],
) -> None:
    def script(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        output = {"name": "y", "dtype": "float32", "shape": HUGE_EMPTY}
        reply = ok_reply(msgpack.unpackb(frames[1]), [output])
        sock.send_multipart([frames[0], msgpack.packb(reply), b""])

    with (
        InferenceClient(server(script), timeout=5) as client,
        pytest.raises(MalformedReply, match="too large"),
    ):
        client.infer("m", {"x": np.zeros(2, np.float32)})
