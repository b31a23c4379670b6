"""Timeouts that are no ordinary number of seconds (second review of the Python
client): ``math.inf`` and timeouts past libzmq's and poll(2)'s C int of
milliseconds (24.8 days) wait as asked instead of raising ``OverflowError``; NaN is
an ``InvalidArgument`` before any socket; ``inferctl --timeout inf`` is no traceback."""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd_client import EventSubscriber, InferenceClient, InvalidArgument, OperatorClient
from inferd_client.cli import main
from inferd_client.shm import RegionChannel, ShmRequest
from inferd_wire import protocol
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES
from tests.conftest import HANG_S

#: Past 2**31 - 1 ms: a C int of milliseconds cannot hold it.
DAYS_100 = 100 * 86400.0


def ok_reply(request: dict[str, Any]) -> dict[str, Any]:
    if request["op"] != "infer":
        return {"v": 1, "id": request["id"], "ok": True, "result": {"done": True}}
    return {
        "v": 1,
        "id": request["id"],
        "ok": True,
        "model": "m",
        "runtime": "onnx_trt_ep",
        "fallback": False,
        "latency_us": 1,
        "queue_us": 1,
        "late": False,
        "outputs": [],
        "thermal": "unknown",
    }


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """``router(name)``: the endpoint of a ROUTER that answers every request ok."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(name: str) -> str:
        endpoint = f"ipc://{tmp_path}/{name}"
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(endpoint)

        def loop() -> None:
            while not stop.is_set():
                if sock.poll(50):
                    frames = sock.recv_multipart()
                    reply = ok_reply(msgpack.unpackb(frames[1]))
                    sock.send_multipart([frames[0], msgpack.packb(reply)])
            sock.close(linger=0)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        threads.append(thread)
        return endpoint

    yield start
    stop.set()
    for thread in threads:
        thread.join(2)


@pytest.mark.parametrize("timeout", [math.inf, DAYS_100])
def test_a_call_may_wait_without_end_or_longer_than_a_c_int_of_milliseconds(
    router: Callable[[str], str], timeout: float
) -> None:
    endpoint = router("infer.sock")
    with InferenceClient(endpoint, timeout=timeout) as client:
        assert client.infer("m", {"x": np.zeros(2, np.float32)}) == {}
    with InferenceClient(endpoint) as client:
        assert client.infer("m", {"x": np.zeros(2, np.float32)}, timeout=timeout) == {}
    with OperatorClient(endpoint, timeout=timeout) as operator:
        assert operator.call("status") == {"done": True}


def test_a_nan_timeout_is_an_invalid_argument(router: Callable[[str], str]) -> None:
    endpoint = router("infer.sock")
    with pytest.raises(InvalidArgument, match="NaN"):
        InferenceClient(endpoint, timeout=math.nan)
    with InferenceClient(endpoint) as client, pytest.raises(InvalidArgument, match="NaN"):
        client.infer("m", {"x": np.zeros(2, np.float32)}, timeout=math.nan)


@pytest.mark.parametrize("timeout", [math.inf, DAYS_100])
def test_a_shm_request_may_wait_without_end(tmp_path: Path, timeout: float) -> None:
    path = str(tmp_path / "shm.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    channel = RegionChannel(path, timeout=timeout, next_id=lambda: 5)
    peer, _ = listener.accept()
    peer.settimeout(HANG_S)

    def answer() -> None:
        request = protocol.unpack_header(peer.recv(MAX_SHM_MESSAGE_BYTES))
        peer.send(protocol.pack({"v": 1, "id": request["id"], "ok": True}))

    request = ShmRequest({"v": 1, "op": "infer", "model": "m", "inputs": []}, [])
    try:
        for per_call in (None, timeout):
            answering = threading.Thread(target=answer)
            answering.start()
            assert channel.request(request, timeout=per_call)["id"] == 5
            answering.join()
    finally:
        channel.close()
        peer.close()
        listener.close()


def test_a_subscriber_waits_any_timeout_and_refuses_nan(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/events.sock"
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(endpoint)
    try:
        with EventSubscriber(endpoint) as subscriber:
            with pytest.raises(InvalidArgument, match="NaN"):
                subscriber.receive(timeout=math.nan)
            # Published until the subscription has joined; then received at once.
            stop = threading.Event()

            def publish() -> None:
                while not stop.wait(0.02):
                    publisher.send_multipart([b"health", msgpack.packb({"state": "serving"})])

            thread = threading.Thread(target=publish)
            thread.start()
            try:
                assert subscriber.receive(timeout=math.inf) is not None
                assert subscriber.receive(timeout=DAYS_100) is not None
            finally:
                stop.set()
                thread.join()
    finally:
        publisher.close(linger=0)


def test_inferctl_takes_an_infinite_timeout(
    router: Callable[[str], str], capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = router("control.sock")
    argv = ["--json", "--timeout", "inf", "--control-endpoint", endpoint, "switch", "m", "tensorrt"]
    assert main(argv) == 0
    assert '"done": true' in capsys.readouterr().out
    argv[2] = "nan"
    assert main(argv) == 2
    assert "NaN" in capsys.readouterr().out
