"""The infer socket refuses a header over ``bus.max_header_bytes`` under the
request's id, read alone (``bus.headers.id_of_oversized``), up to
``MAX_HEADER_FRAME_BYTES``: it refused it with ``id: null``, which both clients
discard, so the call waited out its timeout instead of failing (DESIGN.md 205)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd.bus.codec import Limits
from inferd.bus.dispatch import Dispatcher
from inferd.config.ceilings import MAX_HEADER_FRAME_BYTES
from inferd_client import InferenceClient, RemoteError
from inferd_wire import protocol
from tests.conftest import HANG_S
from tests.unit.bus.test_shared_infer_socket import RecordingHandler
from tests.unit.client.scripted import Script, scripted_routers

LIMITS = Limits(max_message_bytes=1 << 20, max_header_bytes=1024, max_frames=8)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Callable[[Script], str]]:
    yield from scripted_routers(tmp_path)


def dispatcher() -> Dispatcher:
    return Dispatcher(RecordingHandler(), LIMITS, lambda: None)  # type: ignore[arg-type]


def header_of(nbytes: int, request_id: Any = 7) -> bytes:
    """An infer header of about ``nbytes`` bytes (a long model name), its id last."""
    header = {"v": 1, "op": "infer", "model": "m" * nbytes, "inputs": [], "id": request_id}
    return protocol.pack(header)


def refusal(header: bytes) -> dict[str, Any]:
    reply = dispatcher().message([zmq.Frame(b"client"), zmq.Frame(header)], typed=True)
    assert reply is not None and reply.header["ok"] is False
    return reply.header


@pytest.mark.parametrize("request_id", [7, 2**64 - 1, "req-7"])
def test_a_header_over_max_header_bytes_is_refused_under_its_id(request_id: Any) -> None:
    refused = refusal(header_of(2048, request_id))
    assert refused["id"] == request_id
    assert refused["error"]["code"] == "INVALID_ARGUMENT"
    assert "1024" in refused["error"]["message"]


def test_past_the_ceiling_or_with_no_valid_id_the_refusal_has_none() -> None:
    # Past any configurable bus.max_header_bytes, the id is not read (bounded cost).
    assert refusal(header_of(MAX_HEADER_FRAME_BYTES + 1))["id"] is None
    assert refusal(header_of(2048, True))["id"] is None  # no valid id
    # Within the bound but no map: refused for what it holds, with no id to read.
    assert refusal(msgpack.packb([1] * 600))["id"] is None


def test_the_python_client_gets_the_refusal_instead_of_a_timeout(
    server: Callable[[Script], str],
) -> None:
    """Before: ``Timeout`` after the client's timeout (the null-id reply discarded)."""
    dispatch = dispatcher()

    def answer(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        reply = dispatch.message([zmq.Frame(frame) for frame in frames], typed=True)
        assert reply is not None
        sock.send_multipart(reply.parts())

    with (
        InferenceClient(server(answer), timeout=HANG_S) as client,
        pytest.raises(RemoteError) as raised,
    ):
        client.infer("m" * 2048, {"x": np.zeros(1, np.float32)})
    assert raised.value.code == "INVALID_ARGUMENT"
