"""Raw-socket helpers for the integration tests and the benches: talk to the
daemon with plain pyzmq, msgpack and ``SOCK_SEQPACKET``, without the client
library, so malformed and concurrent traffic can be sent exactly as a foreign
client would."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from inferd_client import OperatorClient
from inferd_wire import protocol
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES

IDENTITY_SHAPE = (1, 3, 224, 224)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def infer_header(
    request_id: Any, model: str, tensors: dict[str, np.ndarray], **extra: Any
) -> dict[str, Any]:
    return {
        "v": 1,
        "id": request_id,
        "op": "infer",
        "model": model,
        "inputs": [
            {"name": name, "dtype": array.dtype.name, "shape": list(array.shape)}
            for name, array in tensors.items()
        ],
        **extra,
    }


class RawDealer:
    """One DEALER socket; replies are ``(header, frames)``."""

    def __init__(self, endpoint: str, context: zmq.Context[Any] | None = None) -> None:
        self.socket: zmq.Socket[Any] = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def send(self, parts: Sequence[Any]) -> None:
        self.socket.send_multipart(list(parts), copy=True)

    def send_infer(
        self, request_id: Any, model: str, tensors: dict[str, np.ndarray], **extra: Any
    ) -> None:
        header = infer_header(request_id, model, tensors, **extra)
        self.send([pack(header), *(np.ascontiguousarray(a) for a in tensors.values())])

    def recv_raw(self, timeout: float = 5.0) -> list[bytes] | None:
        if not self.socket.poll(int(timeout * 1000), zmq.POLLIN):
            return None
        return self.socket.recv_multipart()  # type: ignore[no-any-return]

    def recv(self, timeout: float = 5.0) -> tuple[dict[str, Any], list[bytes]]:
        parts = self.recv_raw(timeout)
        assert parts is not None, f"no reply within {timeout} s"
        header = msgpack.unpackb(parts[0], raw=False)
        assert isinstance(header, dict), f"reply header is not a map: {header!r}"
        return header, parts[1:]

    def request(
        self, parts: Sequence[Any], timeout: float = 5.0
    ) -> tuple[dict[str, Any], list[bytes]]:
        self.send(parts)
        return self.recv(timeout)

    def close(self) -> None:
        self.socket.close(linger=0)

    def __enter__(self) -> RawDealer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assert_error(header: dict[str, Any], code: str, fragment: str, request_id: Any = None) -> None:
    """``header`` is a well-formed error reply with ``code``, a message containing
    ``fragment`` (case-insensitive) and ``id == request_id``."""
    assert header.get("v") == 1, header
    assert header.get("ok") is False, header
    error = header.get("error")
    assert isinstance(error, dict), header
    assert error.get("code") == code, header
    message = error.get("message")
    assert isinstance(message, str), header
    assert fragment.lower() in message.lower(), f"{fragment!r} not in {message!r}"
    assert header.get("id") == request_id, f"id {header.get('id')!r} != {request_id!r}"


def model_status(control: str, name: str) -> dict[str, Any]:
    with OperatorClient(control, timeout=5) as operator:
        models = operator.status()["models"]
    return next(model for model in models if model["model"] == name)


def queue_depth(control: str, name: str) -> int:
    with OperatorClient(control, timeout=5) as operator:
        return int(operator.health()["models"][name]["queue_depth"])


class RawShm:
    """A connection to ``shm.sock`` that sends exactly the bytes it is given, one
    message at a time, and reads the one reply each gets."""

    def __init__(self, path: str, timeout: float = 10) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.socket.settimeout(timeout)
        self.socket.connect(path)

    def exchange(self, message: bytes, fds: Sequence[int] = ()) -> dict[str, Any]:
        socket.send_fds(self.socket, [message], list(fds))
        return protocol.unpack_header(self.socket.recv(MAX_SHM_MESSAGE_BYTES))

    def call(self, header: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        return self.exchange(pack(header), fds)

    def close(self) -> None:
        self.socket.close()

    def __enter__(self) -> RawShm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
