"""Timeouts that are no ordinary number of seconds (second review of the Python
client): ``math.inf`` and timeouts past libzmq's and poll(2)'s C int of
milliseconds (24.8 days) wait as asked instead of raising ``OverflowError``; NaN is
an ``InvalidArgument`` before any socket; ``inferctl --timeout inf`` is no traceback."""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Callable
from pathlib import Path

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
from tests.unit.client.scripted import Script, answer_ok

#: Past 2**31 - 1 ms: a C int of milliseconds cannot hold it.
DAYS_100 = 100 * 86400.0


@pytest.mark.parametrize("timeout", [math.inf, DAYS_100])
def test_a_call_may_wait_without_end_or_longer_than_a_c_int_of_milliseconds(
    server: Callable[[Script], str], timeout: float
) -> None:
    endpoint = server(answer_ok)
    with InferenceClient(endpoint, timeout=timeout) as client:
        assert client.infer("m", {"x": np.zeros(2, np.float32)}) == {}
    with InferenceClient(endpoint) as client:
        assert client.infer("m", {"x": np.zeros(2, np.float32)}, timeout=timeout) == {}
    with OperatorClient(endpoint, timeout=timeout) as operator:
        assert operator.call("status") == {"done": True}


def test_a_nan_timeout_is_an_invalid_argument(server: Callable[[Script], str]) -> None:
    endpoint = server(answer_ok)
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
    server: Callable[[Script], str], capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = server(answer_ok)
    argv = ["--json", "--timeout", "inf", "--control-endpoint", endpoint, "switch", "m", "tensorrt"]
    assert main(argv) == 0
    assert '"done": true' in capsys.readouterr().out
    argv[2] = "nan"
    assert main(argv) == 2
    assert "NaN" in capsys.readouterr().out
