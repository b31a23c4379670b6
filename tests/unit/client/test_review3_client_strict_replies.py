"""Infer replies the schemas and the C++ client refuse are ``MalformedReply`` for the
Python client too (third review of the Python client, finding 3): an output
descriptor with a key the protocol does not have, two outputs of one name (the
first was dropped without an error, or both copied into one ``outputs=`` array),
and a reply naming another model than the request (another model's answer) were
all taken."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd_client import InferenceClient, MalformedReply
from inferd_client.prepared import parse_outputs
from inferd_client.replies import check_infer_reply
from tests.unit.client.scripted import Script, ok_reply

Y = {"name": "y", "dtype": "float32", "shape": [2]}
ONE = np.array([1.0, 2.0], np.float32).tobytes()
TWO = np.array([3.0, 4.0], np.float32).tobytes()
REGION_ID = "ab" * 16


def replying(outputs: list[dict[str, Any]], frames: list[bytes], model: str = "m") -> Script:
    """A script: every infer request answered ok with ``outputs``, ``frames`` and ``model``."""

    def script(sock: zmq.Socket[Any], parts: list[bytes]) -> None:
        reply = ok_reply(msgpack.unpackb(parts[1]), outputs)
        reply["model"] = model
        sock.send_multipart([parts[0], msgpack.packb(reply), *frames])

    return script


#: Inputs sent as they are (a kept ``FramesRequest``, whose reply parsing is reused)
#: and inputs copied first (a one-off header, its reply parsed afresh).
INPUTS: dict[str, Callable[[], dict[str, np.ndarray]]] = {
    "kept": lambda: {"x": np.zeros(2, np.float32)},
    "one-off": lambda: {"x": np.zeros((2, 2), np.float32)[:, 0]},
}


@pytest.mark.parametrize("inputs", sorted(INPUTS))
@pytest.mark.parametrize(
    ("outputs", "frames", "model", "why"),
    [
        ([{**Y, "offset": 0}], [ONE], "m", "keys the protocol does not have: ['offset']"),
        ([{**Y, "scale": 1000}], [ONE], "m", "keys the protocol does not have: ['scale']"),
        ([Y, dict(Y)], [ONE, TWO], "m", "output 'y' is listed twice"),
        ([Y], [ONE], "other", "names the model 'other'; the request named 'm'"),
        ([Y], [ONE], "\x1b[2J", "names the model '\\x1b[2J'"),
    ],
    ids=["offset-key", "scale-key", "name-twice", "other-model", "escape-model"],
)
def test_a_reply_the_schemas_refuse_is_malformed(
    server: Callable[[Script], str],
    inputs: str,
    outputs: list[dict[str, Any]],
    frames: list[bytes],
    model: str,
    why: str,
) -> None:
    endpoint = server(replying(outputs, frames, model))
    with (
        InferenceClient(endpoint, timeout=5) as client,
        pytest.raises(MalformedReply, match=re.escape(why)),
    ):
        client.infer("m", INPUTS[inputs]())
    # The same call, answered as the protocol says, is taken.
    good = server(replying([Y], [ONE]))
    with InferenceClient(good, timeout=5) as client:
        assert client.infer("m", INPUTS[inputs]())["y"].tolist() == [1.0, 2.0]


def test_a_name_listed_twice_writes_nothing_into_the_callers_array(
    server: Callable[[Script], str],
) -> None:
    endpoint = server(replying([Y, dict(Y)], [ONE, TWO]))
    target = np.full(2, -1.0, np.float32)
    with InferenceClient(endpoint, timeout=5) as client, pytest.raises(MalformedReply):
        client.infer("m", {"x": np.zeros(2, np.float32)}, outputs={"y": target})
    assert target.tolist() == [-1.0, -1.0]


def test_a_region_descriptor_may_have_its_range_but_no_other_key() -> None:
    placed = {**Y, "region": REGION_ID, "offset": 256, "nbytes": 8}
    assert [name for name, *_ in parse_outputs([placed, {**Y, "name": "z"}])] == ["y", "z"]
    with pytest.raises(MalformedReply, match=r"keys the protocol does not have: \['scale'\]"):
        parse_outputs([{**placed, "scale": 2}])
    # A framed descriptor has no range: offset and nbytes without a region are unknown.
    with pytest.raises(MalformedReply, match=r"\['nbytes', 'offset'\]"):
        parse_outputs([{**Y, "offset": 256, "nbytes": 8}])
    # A bin key (msgpack lets one through unpack_header) is named, not a TypeError.
    with pytest.raises(MalformedReply, match=r"\['k', b'k'\]"):
        parse_outputs([{**Y, "k": 1, b"k": 2}])


def test_check_infer_reply_compares_the_model_only_when_given_one() -> None:
    reply = ok_reply({"op": "infer", "id": 1})
    check_infer_reply(reply)
    check_infer_reply(reply, "m")
    with pytest.raises(MalformedReply, match="the request named 'n'"):
        check_infer_reply(reply, "n")
