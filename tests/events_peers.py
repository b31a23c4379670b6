"""Peers of the events socket that no well-behaved subscriber would be (DESIGN.md 124):
a raw ZMTP 3.0 connection that can send a frame of any size, and a subscriber in
a child process (the daemon ends every events connection of a refused peer's
process, so the test's own subscribers must be in another one)."""

from __future__ import annotations

import select
import socket
import subprocess
import sys

from tests.conftest import HANG_S

#: ZMTP 3.0 greeting, NULL mechanism, as a client.
_GREETING = (
    b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
)


def _ready(socket_type: bytes) -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return bytes([0x04, len(body)]) + body  # a short command frame


def long_frame_header(size: int) -> bytes:
    """The header of a (last) message frame of ``size`` bytes, in ZMTP's long form."""
    return b"\x02" + size.to_bytes(8, "big")


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(data)} bytes")
        data += chunk
    return data


def zmtp_connect(endpoint: str, socket_type: bytes = b"SUB") -> socket.socket:
    """A Unix stream connection to the ``ipc://`` ``endpoint`` whose handshake is
    done (greetings and READYs exchanged): what it sends next is read as messages."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(HANG_S)
    conn.connect(endpoint.removeprefix("ipc://"))
    conn.sendall(_GREETING + _ready(socket_type))
    _read(conn, len(_GREETING))
    flags, size = _read(conn, 2)
    assert flags == 0x04, f"expected the peer's READY (a short command), got flags {flags:#x}"
    assert _read(conn, size).startswith(b"\x05READY")
    return conn


def send_until_closed(conn: socket.socket, data: bytes) -> int:
    """Send ``data``; the bytes the peer took before it closed the connection."""
    sent = 0
    view = memoryview(data)
    try:
        while sent < len(data):
            sent += conn.send(view[sent : sent + 65536])
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def closed_by_peer(conn: socket.socket, timeout: float = HANG_S) -> bool:
    """Whether the peer closes ``conn`` within ``timeout`` s (what it sends is discarded)."""
    conn.settimeout(timeout)
    try:
        while conn.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


_CHILD = """
import sys
import zmq

endpoint, message = sys.argv[1], bytes.fromhex(sys.argv[2])
sock = zmq.Context.instance().socket(zmq.XSUB)  # XSUB: nothing is filtered on this side
monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
sock.connect(endpoint)
sock.send(message)  # an XSUB sends a subscription again at each reconnection
monitor.recv_multipart()
print("disconnected", flush=True)
sys.stdin.read()
received = 0
while sock.poll(0):
    sock.recv()
    received += 1
print(received, flush=True)
"""


class ChildSubscriber:
    """An XSUB in a child process that connects to ``endpoint`` and sends ``message``
    (``b"\\x01" + topic`` subscribes).  ``disconnected`` waits for the peer to close
    its connection; ``received`` ends it and says how many messages it got."""

    def __init__(self, endpoint: str, message: bytes) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, endpoint, message.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _line(self, timeout: float) -> str | None:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        return self.process.stdout.readline().strip() if ready else None

    def disconnected(self, timeout: float = HANG_S) -> bool:
        return self._line(timeout) == "disconnected"

    def received(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.close()
        line = self._line(HANG_S)
        assert line is not None, "the child subscriber did not answer"
        self.process.wait(timeout=HANG_S)
        return int(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> ChildSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
