"""A request too large for one ``shm.sock`` message goes on the infer socket.

The daemon reads at most ``MAX_SHM_MESSAGE_BYTES`` of a shm message and refuses a
longer one without an id (it cannot read one).  After a request on the shm socket
had timed out, the client took that refusal for the late answer of the one that
timed out: a call naming many tensors with long names timed out instead of
being served."""

from __future__ import annotations

import array
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd_client import InferenceClient, RequestTimeout
from inferd_wire import protocol
from inferd_wire.protocol import Code
from inferd_wire.regions import MAX_REGION_TENSORS, MAX_SHM_MESSAGE_BYTES, REGION_ALIGNMENT
from tests.conftest import HANG_S
from tests.unit.client.scripted import Script, ok_reply

REGION_ID = "ab" * 16
#: Long enough that a request naming 64 tensors is over the shm socket's bound.
LONG = "t" * 300
BIG_INPUTS = [f"{LONG}_in{i}" for i in range(MAX_REGION_TENSORS // 2)]
BIG_OUTPUTS = [f"{LONG}_out{i}" for i in range(MAX_REGION_TENSORS // 2)]


class ShmSocketAsTheDaemon:
    """A ``shm.sock`` that answers as the daemon does: a registration with a region
    id, a message over the bound with a refusal without an id; it leaves the
    first infer request unanswered (so that it times out) and answers the others."""

    def __init__(self, path: str) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(path)
        self._listener.listen(1)
        self._listener.settimeout(HANG_S)
        self.infer_requests = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        peer, _ = self._listener.accept()
        peer.settimeout(HANG_S)
        with peer:
            while True:
                try:
                    data, ancillary, flags, _ = peer.recvmsg(
                        MAX_SHM_MESSAGE_BYTES, socket.CMSG_SPACE(array.array("i").itemsize)
                    )
                except OSError:
                    return
                if not data:
                    return  # the client closed its connection
                for _level, _type, fds in ancillary:
                    for fd in array.array("i", fds):
                        socket.close(fd)
                answer = self._answer(data, flags)
                if answer is not None:
                    peer.send(protocol.pack(answer))

    def _answer(self, data: bytes, flags: int) -> dict[str, Any] | None:
        if flags & socket.MSG_TRUNC:
            error = f"message is over {MAX_SHM_MESSAGE_BYTES} bytes"
            return protocol.error_header(None, Code.INVALID_ARGUMENT, error)
        header = protocol.unpack_header(data)
        if header["op"] == "register":
            return protocol.ok_header(header["id"], result={"region": REGION_ID})
        self.infer_requests += 1
        if self.infer_requests == 1:
            return None
        return ok_reply(header, header["outputs"])

    def close(self) -> None:
        self._listener.close()
        self._thread.join(HANG_S)


def answer_as_the_daemon(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
    """The infer socket: ``describe`` lists a small and a big model; an infer
    request is answered ok with its placed outputs, written where asked."""
    request = msgpack.unpackb(frames[1])
    if request["op"] == "describe":
        models = [
            {"name": "small", "outputs": [{"name": "y"}]},
            {"name": "big", "outputs": [{"name": name} for name in BIG_OUTPUTS]},
        ]
        reply = protocol.ok_header(request["id"], result={"models": models})
    else:
        reply = ok_reply(request, request.get("outputs", []))
    sock.send_multipart([frames[0], msgpack.packb(reply)])


def test_a_request_over_the_shm_sockets_bound_goes_on_the_infer_socket(
    tmp_path: Path, server: Callable[[Script], str]
) -> None:
    shm = ShmSocketAsTheDaemon(str(tmp_path / "shm.sock"))
    endpoint = server(answer_as_the_daemon)
    try:
        with InferenceClient(
            endpoint, timeout=HANG_S, shm_socket=str(tmp_path / "shm.sock")
        ) as client:
            region = client.shared_region((MAX_REGION_TENSORS + 2) * REGION_ALIGNMENT)
            client.describe()
            x, y = region.array(1, np.float32), region.array(1, np.float32)
            with pytest.raises(RequestTimeout):
                client.infer("small", {"x": x}, outputs={"y": y}, timeout=0.1)
            # Set as it was sent: the call that timed out went on the shm socket.
            assert client.last_transport == "shm" and shm.infer_requests == 1

            inputs = {name: region.array(1, np.float32) for name in BIG_INPUTS}
            outputs = {name: region.array(1, np.float32) for name in BIG_OUTPUTS}
            result = client.infer("big", inputs, outputs=outputs)
            assert client.last_transport == "infer" and shm.infer_requests == 1
            assert all(result[name] is outputs[name] for name in BIG_OUTPUTS)

            # A request that fits still goes on the shm socket, and is answered.
            assert client.infer("small", {"x": x}, outputs={"y": y})["y"] is y
            assert client.last_transport == "shm" and shm.infer_requests == 2
    finally:
        shm.close()
