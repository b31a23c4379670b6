"""A request header no daemon reads is refused before it is sent (third review of
the Python client, finding 5).  Over ``MAX_HEADER_FRAME_BYTES`` (256 KiB, every
``bus.max_header_bytes``' ceiling) the daemon reads not even the id, and refuses
with ``id: null``, which the client discards as no call's: a 300,000-character
input name took the whole timeout of every attempt (6.01 s at 3 s x 2) and raised
``RequestTimeout``, which ``inferctl`` reports as an unreachable daemon (exit 3)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from inferd_client import InferenceClient, InvalidArgument, OperatorClient
from inferd_client.prepared import PreparedHeader
from inferd_wire import protocol
from tests.unit.client.scripted import Script, answer_ok

#: What a call that waited for a reply would take at the least (its timeout).
TIMEOUT_S = 5.0


def silent(received: list[list[bytes]]) -> Script:
    """A script that notes each request and never answers it."""

    def script(_sock: zmq.Socket[Any], parts: list[bytes]) -> None:
        received.append(parts)

    return script


def padded(bytes_: int) -> dict[str, Any]:
    """A control request header whose ``PreparedHeader.max_bytes`` is ``bytes_``."""
    base = {"v": 1, "op": "status", "pad": "a" * 70_000}
    size = PreparedHeader(base).max_bytes
    return {**base, "pad": "a" * (70_000 + bytes_ - size)}


def test_the_bound_is_the_daemons_ceiling_to_the_byte() -> None:
    assert PreparedHeader(padded(protocol.MAX_HEADER_FRAME_BYTES)).max_bytes == 256 * 1024
    with pytest.raises(InvalidArgument, match=r"is 262145 bytes; the limit is 262144"):
        PreparedHeader(padded(protocol.MAX_HEADER_FRAME_BYTES + 1))


@pytest.mark.parametrize(
    "inputs",
    [
        {"x" * 300_000: np.zeros(4, np.float32)},  # a kept frames request
        {"x" * 300_000: np.zeros((4, 2), np.float32)[:, 0]},  # a one-off header
        # no long name: 1,024 inputs of 304 characters each
        {f"{i:04d}" + "x" * 300: np.zeros(1, np.float32) for i in range(1024)},
    ],
    ids=["kept", "one-off", "many"],
)
def test_infer_refuses_a_header_no_daemon_reads_before_sending_it(
    server: Callable[[Script], str], inputs: dict[str, np.ndarray]
) -> None:
    received: list[list[bytes]] = []
    endpoint = server(silent(received))
    with InferenceClient(endpoint, timeout=TIMEOUT_S, retries=1) as client:
        started = time.monotonic()
        with pytest.raises(InvalidArgument, match=r"the limit is 262144") as refused:
            client.infer("m", inputs)
        elapsed = time.monotonic() - started
        assert client.last_transport == ""  # nothing was sent on either socket
    assert elapsed < 0.5, f"{elapsed:.3f} s: it waited for a reply"
    assert "request header is" in str(refused.value)
    assert received == []


def test_a_control_call_refuses_one_too(server: Callable[[Script], str]) -> None:
    received: list[list[bytes]] = []
    endpoint = server(silent(received))
    with OperatorClient(endpoint, timeout=TIMEOUT_S) as operator:
        started = time.monotonic()
        with pytest.raises(InvalidArgument, match=r"the limit is 262144"):
            operator.call("runtime.switch", model="m" * 300_000, runtime="tensorrt")
        assert time.monotonic() - started < 0.5
    assert received == []


def test_a_header_within_the_bound_is_sent(server: Callable[[Script], str]) -> None:
    # 200,000 characters: over the daemon's default bound (64 KiB), which refuses
    # it under its id (INVALID_ARGUMENT); the client leaves that to the daemon.
    with InferenceClient(server(answer_ok), timeout=TIMEOUT_S) as client:
        assert client.infer("m", {"x" * 200_000: np.zeros(4, np.float32)}) == {}
