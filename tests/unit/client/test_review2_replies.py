"""Replies and events that break the protocol raise ``MalformedReply`` (second review
of the Python client): they raised ``TypeError``, ``AttributeError``, ``KeyError``
or msgpack's own errors, none of them a ``ClientError``, or were taken as another
request's answer (an id ``true`` equals the first registration's id ``1``)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from inferd_client import EventSubscriber, InferenceClient, MalformedReply, OperatorClient
from inferd_client.region import SharedRegion
from inferd_client.shm import RegionChannel
from inferd_wire import protocol
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES
from tests.conftest import HANG_S
from tests.unit.client.scripted import Script

REGION_ID = "ab" * 16


def answered_by(path: str, reply: Callable[[dict[str, Any]], dict[str, Any]]) -> threading.Thread:
    """A ``shm.sock`` listener at ``path`` that answers the first message with ``reply``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        peer, _ = listener.accept()
        peer.settimeout(HANG_S)
        try:
            request = protocol.unpack_header(peer.recv(MAX_SHM_MESSAGE_BYTES))
            peer.send(msgpack.packb(reply(request)))
            peer.recv(1)  # until the client closes
        except OSError:
            pass
        finally:
            peer.close()
            listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "reply",
    [
        # an id no request has: a list (it raised TypeError: unhashable), a boolean
        # (``True == 1``: taken as the first registration's answer), a float
        lambda request: {"v": 1, "id": [1], "ok": True, "result": {"region": REGION_ID}},
        lambda request: {"v": 1, "id": True, "ok": True, "result": {"region": REGION_ID}},
        lambda request: {"v": 1, "id": 1.0, "ok": True, "result": {"region": REGION_ID}},
        # an error that is no map (AttributeError), one without a code ("None: None")
        lambda request: {"v": 1, "id": request["id"], "ok": False, "error": "boom"},
        lambda request: {"v": 1, "id": request["id"], "ok": False, "error": {"message": "x"}},
        # neither ok nor an error
        lambda request: {"v": 1, "id": request["id"], "ok": "yes", "result": {}},
    ],
    ids=["list-id", "bool-id", "float-id", "error-str", "error-no-code", "ok-str"],
)
def test_a_malformed_registration_reply_is_malformed(
    tmp_path: Path, reply: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    path = str(tmp_path / "shm.sock")
    thread = answered_by(path, reply)
    channel = RegionChannel(path, timeout=2.0)
    try:
        with SharedRegion(4096) as region, pytest.raises(MalformedReply):
            channel.register(region)
    finally:
        channel.close()
        thread.join(HANG_S)


@pytest.fixture
def control(server: Callable[[Script], str]) -> Callable[[dict[str, Any]], str]:
    """``control(reply)``: a ROUTER that answers every request with ``reply`` and its id."""

    def start(reply: dict[str, Any]) -> str:
        def answer(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
            answered = {**reply, "id": msgpack.unpackb(frames[1])["id"]}
            sock.send_multipart([frames[0], msgpack.packb(answered)])

        return server(answer)

    return start


@pytest.mark.parametrize(
    "reply",
    [{"v": 1, "ok": True}, {"v": 1, "ok": True, "result": [1, 2]}],
    ids=["no-result", "result-list"],
)
def test_a_control_reply_without_a_result_map_is_malformed(
    control: Callable[[dict[str, Any]], str], reply: dict[str, Any]
) -> None:
    endpoint = control(reply)
    with OperatorClient(endpoint, timeout=2) as operator, pytest.raises(MalformedReply):
        operator.status()
    with InferenceClient(endpoint, timeout=2) as client, pytest.raises(MalformedReply):
        client.describe()


@pytest.mark.parametrize(
    "models",
    [7, [{"name": "m", "outputs": ["y"]}], [{"name": "m", "outputs": [{"name": ["y"]}]}]],
    ids=["models-int", "output-str", "output-name-list"],
)
def test_a_describe_reply_with_malformed_models_is_malformed(
    control: Callable[[dict[str, Any]], str], models: Any
) -> None:
    endpoint = control({"v": 1, "ok": True, "result": {"models": models}})
    with InferenceClient(endpoint, timeout=2) as client, pytest.raises(MalformedReply):
        client.describe()


@pytest.mark.parametrize(
    "event",
    [[b"health", b"\xc1"], [b"health", b"\x80\x80"], [b"\xffhealth", msgpack.packb({})]],
    ids=["not-msgpack", "extra-data", "topic-not-utf8"],
)
def test_a_malformed_event_is_malformed(tmp_path: Path, event: list[bytes]) -> None:
    endpoint = f"ipc://{tmp_path}/events.sock"
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(endpoint)
    try:
        with EventSubscriber(endpoint) as subscriber:
            give_up_at = time.monotonic() + HANG_S
            with pytest.raises(MalformedReply):  # sent until the subscription joined
                while time.monotonic() < give_up_at:
                    publisher.send_multipart(event)
                    subscriber.receive(timeout=0.05)
    finally:
        publisher.close(linger=0)
