"""A client used in a child ``fork()`` made after the client (second review of the
Python client): it fails at once with a ``ClientError`` saying so, never waits past
its timeout (ZeroMQ's calls in such a child retry forever), and never sends on the
parent's ``shm.sock`` connection (whose replies the parent reads)."""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd_client import EventSubscriber, InferenceClient
from inferd_client.shm import RegionChannel, ShmRequest
from inferd_wire import protocol
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES
from tests.conftest import HANG_S
from tests.unit.client.scripted import Script, answer_ok

#: How long a child may take to answer before it is taken as hung (each call in
#: it is given 0.5 s).
CHILD_S = 8.0


def in_child(call: Callable[[], Any]) -> str:
    """What ``call`` did in a forked child: ``"returned"``, ``"<Type>: <message>"``
    for an exception, or ``"hung"`` when it had not finished within ``CHILD_S``
    (the child is then killed)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running any cleanup
        try:
            os.close(read_end)
            try:
                call()
                outcome = "returned"
            except BaseException as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            os.write(write_end, outcome.encode()[:4000])
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], CHILD_S)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            return "hung"
        return os.read(read_end, 4096).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


@pytest.fixture
def answering_router(server: Callable[[Script], str]) -> str:
    """A ROUTER that answers every infer request with an empty ok reply."""
    return server(answer_ok)


def test_an_inference_client_used_after_fork_fails_at_once_and_never_hangs(
    answering_router: str,
) -> None:
    with InferenceClient(answering_router, timeout=0.5) as client:
        x = np.zeros(4, np.float32)
        assert client.infer("m", {"x": x}) == {}  # the parent's client works
        started = time.monotonic()
        outcome = in_child(lambda: client.infer("m", {"x": x}, timeout=0.5))
        assert outcome.startswith("ClientError:") and "fork()" in outcome, outcome
        assert time.monotonic() - started < CHILD_S
        assert client.infer("m", {"x": x}) == {}  # and still works in the parent


def test_a_subscriber_used_after_fork_fails_at_once_and_never_hangs(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/events.sock"
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(endpoint)
    try:
        with EventSubscriber(endpoint) as subscriber:
            assert subscriber.receive(timeout=0.05) is None
            outcome = in_child(lambda: subscriber.receive(timeout=0.5))
            assert outcome.startswith("ClientError:") and "fork()" in outcome, outcome
    finally:
        publisher.close(linger=0)


def test_a_shm_connection_used_after_fork_sends_nothing_on_the_parents_connection(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "shm.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    ids = iter((7, 8))
    channel = RegionChannel(path, timeout=HANG_S, next_id=lambda: next(ids))
    peer, _ = listener.accept()
    request = ShmRequest({"v": 1, "op": "infer", "model": "m", "inputs": []}, [])
    try:
        outcome = in_child(lambda: channel.request(request, timeout=0.5))
        assert outcome.startswith("ClientError:") and "fork()" in outcome, outcome
        # Nothing of the child's reached the daemon's end of the parent's connection.
        peer.settimeout(0.2)
        with pytest.raises(TimeoutError):
            peer.recv(MAX_SHM_MESSAGE_BYTES)
        # The parent's own requests go on as ever.
        peer.settimeout(HANG_S)
        reply = threading.Timer(
            0.05,
            lambda: peer.send(
                protocol.pack({"v": 1, "id": protocol.unpack_header(peer.recv(4096))["id"]})
            ),
        )
        reply.start()
        assert channel.request(request, timeout=HANG_S)["id"] == 7  # the child took none
        reply.join()
    finally:
        channel.close()
        peer.close()
        listener.close()
