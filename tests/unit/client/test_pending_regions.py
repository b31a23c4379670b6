"""A region the daemon let go (it restarted) and will not take back fails no call.

Before: after a restart whose daemon refused a client's region (``[shm] enabled =
false``, a ``max_bytes_per_uid`` below the region's size, bounds other clients
fill), every ``infer`` of that client raised, also calls naming no region, and
``register_region`` of a new region failed on the old one: each call first
registered every released region again and raised at the first refused.  Now
only a call naming a released region's array tries to register it, at most
once per backoff delay; while it cannot, its arrays travel as frames and
``shm_regions`` says why.  And ``last_transport`` names the socket a call that
raised was sent on (it kept the previous call's).

The daemon is played by a scripted ROUTER (the infer socket) and a scripted
``shm.sock`` (``ShmDaemon``) that can restart and refuse, or go away."""

from __future__ import annotations

import array
import contextlib
import os
import select
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd_client import InferenceClient, RequestTimeout, Unreachable
from inferd_client import pending_regions as pending_module
from inferd_wire import protocol
from inferd_wire.protocol import Code
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES
from tests.conftest import HANG_S
from tests.unit.client.scripted import Script, ok_reply

#: What the infer socket writes into an output it sends as a frame.
FRAME_OUTPUT = np.array([7.0, 7.0], np.float32)


class ShmDaemon:
    """A ``shm.sock`` as the daemon serves it: registrations answered with a new
    region id unless ``refuse(label)`` says why not (``RESOURCE_EXHAUSTED``, as a
    bound would), infer requests answered with their placed outputs.
    ``restart()`` closes every connection (a restart releases every region);
    ``remove()`` takes the socket away (a daemon with shm disabled)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.refuse: Callable[[str | None], str | None] = lambda label: None
        self.registered: list[str | None] = []  # each registration's label, in order
        self.refused: list[str | None] = []
        self.infer_requests = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(path)
        self._listener.listen(4)
        self._peers: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                peers = list(self._peers)
            readable, _, _ = select.select([self._listener, *peers], [], [], 0.05)
            for sock in readable:
                if sock is self._listener:
                    peer, _ = self._listener.accept()
                    with self._lock:
                        self._peers.append(peer)
                    continue
                with contextlib.suppress(OSError):
                    self._read(sock)

    def _read(self, peer: socket.socket) -> None:
        data, ancillary, _, _ = peer.recvmsg(
            MAX_SHM_MESSAGE_BYTES, socket.CMSG_SPACE(array.array("i").itemsize)
        )
        for _level, _type, fds in ancillary:
            for fd in array.array("i", fds):
                os.close(fd)
        if not data:  # the client (or ``restart``) ended it
            with self._lock:
                if peer in self._peers:
                    self._peers.remove(peer)
            peer.close()
            return
        self._answer(peer, data)

    def _answer(self, peer: socket.socket, data: bytes) -> None:
        header = protocol.unpack_header(data)
        if header["op"] == "register":
            label = header.get("label")
            why = self.refuse(label)
            if why is not None:
                self.refused.append(label)
                reply = protocol.error_header(header["id"], Code.RESOURCE_EXHAUSTED, why)
            else:
                self.registered.append(label)
                region_id = f"{len(self.registered):032x}"
                reply = protocol.ok_header(header["id"], result={"region": region_id})
        elif header["op"] == "unregister":
            reply = protocol.ok_header(header["id"], result={"region": header["region"]})
        else:
            self.infer_requests += 1
            reply = ok_reply(header, header["outputs"])
        peer.send(protocol.pack(reply))

    def restart(self) -> None:
        """End every connection now: once this returns, the client's next poll of
        its connection sees it closed."""
        with self._lock:
            for peer in self._peers:
                peer.shutdown(socket.SHUT_RDWR)

    def remove(self) -> None:
        os.unlink(self.path)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(HANG_S)
        for sock in (*self._peers, self._listener):
            sock.close()


class InferSocket:
    """The infer socket's script: model ``m`` (input ``x``, output ``y``) answered
    with ``y`` placed where asked, else ``FRAME_OUTPUT`` as a frame; model ``slow``
    never answered.  ``sent`` notes how each request sent ``x`` and ``y``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def __call__(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        request = msgpack.unpackb(frames[1])
        if request["model"] == "slow":
            return
        placed = request.get("outputs", [])
        x_in_region = "region" in request["inputs"][0]
        self.sent.append(("region" if x_in_region else "frame", "placed" if placed else "frame"))
        if placed:
            sock.send_multipart([frames[0], msgpack.packb(ok_reply(request, placed))])
            return
        outputs = [{"name": "y", "dtype": "float32", "shape": [2]}]
        reply = msgpack.packb(ok_reply(request, outputs))
        sock.send_multipart([frames[0], reply, FRAME_OUTPUT.tobytes()])


class Clock:
    """The pending regions' clock, moved by the test instead of waited for."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(pending_module, "monotonic", fake)
    return fake


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[ShmDaemon]:
    daemon = ShmDaemon(str(tmp_path / "shm.sock"))
    yield daemon
    daemon.close()


@pytest.fixture
def infer_socket() -> InferSocket:
    return InferSocket()


@pytest.fixture
def client(
    server: Callable[[Script], str], shm: ShmDaemon, infer_socket: InferSocket
) -> Iterator[InferenceClient]:
    with InferenceClient(server(infer_socket), timeout=HANG_S, shm_socket=shm.path) as made:
        yield made


def _served_on_shm(client: InferenceClient, x: np.ndarray, y: np.ndarray) -> None:
    """A call that learns ``m``'s outputs, then one on the shm socket."""
    client.infer("m", {"x": x}, outputs={"y": y})
    client.infer("m", {"x": x}, outputs={"y": y})
    assert client.last_transport == "shm"


def _restart_found_on_shm(client: InferenceClient, shm: ShmDaemon, x: Any, y: Any) -> None:
    """The daemon restarts, refusing ``big``; the next call on the shm socket finds
    its connection closed and fails, saying so (DESIGN.md 161: the request may
    have been sent), and only the calls after it register again."""
    shm.restart()
    shm.refuse = _refusing_big
    with pytest.raises(Unreachable, match="registers again"):
        client.infer("m", {"x": x}, outputs={"y": y})


def _refusing_big(label: str | None) -> str | None:
    if label == "big":
        return "uid 0 has 0 bytes mapped; this region's 8192 would exceed shm.max_bytes_per_uid"
    return None


@pytest.mark.parametrize("restarted", ["refusing", "without shm"])
def test_a_region_the_restarted_daemon_will_not_take_fails_no_call(
    client: InferenceClient,
    shm: ShmDaemon,
    infer_socket: InferSocket,
    clock: Clock,
    restarted: str,
) -> None:
    big = client.shared_region(8192, label="big")
    x, y = big.array(2, np.float32), big.array(2, np.float32)
    x[:] = 1.0
    _served_on_shm(client, x, y)
    shm.restart()
    if restarted == "refusing":
        shm.refuse = _refusing_big
    else:
        shm.remove()

    # A call naming no region is served (before: refused with the region's error).
    plain = client.infer("m", {"x": np.ones(2, np.float32)})
    assert (plain["y"] == FRAME_OUTPUT).all() and client.last_transport == "infer"
    assert client.shm_regions["pending"][0]["failures"] == 0  # named by no call: not tried

    # A call naming the region is served, its arrays as frames, and says why once.
    y[:] = 0.0
    assert client.infer("m", {"x": x}, outputs={"y": y})["y"] is y
    assert (y == FRAME_OUTPUT).all() and client.last_transport == "infer"
    assert infer_socket.sent[-1] == ("frame", "frame")
    regions = client.shm_regions
    assert regions["registered"] == 0 and regions["failed_registrations"] == 1
    [pending] = regions["pending"]
    assert pending["label"] == "big" and pending["nbytes"] == 8192
    assert pending["failures"] == 1 and pending["retry_in_s"] == pending_module.RETRY_FIRST_S
    if restarted == "refusing":
        assert "RESOURCE_EXHAUSTED" in pending["error"] and shm.refused == ["big"]
    else:
        assert pending["error"].startswith("Unreachable: cannot connect")

    # Not asked again before its delay: a camera loop does not hammer the daemon.
    for _ in range(3):
        client.infer("m", {"x": x}, outputs={"y": y})
    assert client.shm_regions["failed_registrations"] == 1
    assert shm.refused == (["big"] if restarted == "refusing" else [])

    # A new region is registered: the one pending does not make it fail.
    if restarted == "refusing":
        small = client.shared_region(4096, label="small")
        assert shm.registered == ["big", "small"] and client.shm_regions["registered"] == 1
        z = small.array(2, np.float32)
        client.infer("m", {"x": z})
        assert infer_socket.sent[-1] == ("region", "frame")
    else:
        with pytest.raises(Unreachable, match="cannot connect"):
            client.shared_region(4096, label="small")

    # Once its delay has passed, a call naming it tries again; failing, the delay doubles.
    clock.now += pending_module.RETRY_FIRST_S
    client.infer("m", {"x": x}, outputs={"y": y})
    [pending] = client.shm_regions["pending"]
    assert pending["failures"] == 2 and pending["retry_in_s"] == 2 * pending_module.RETRY_FIRST_S


def test_a_pending_region_is_registered_again_by_a_call_naming_it_once_allowed(
    client: InferenceClient, shm: ShmDaemon, infer_socket: InferSocket, clock: Clock
) -> None:
    big = client.shared_region(8192, label="big")
    x, y = big.array(2, np.float32), big.array(2, np.float32)
    _served_on_shm(client, x, y)
    _restart_found_on_shm(client, shm, x, y)
    client.infer("m", {"x": x}, outputs={"y": y})
    assert client.shm_regions["pending"][0]["failures"] == 1
    shm.refuse = lambda label: None  # an operator raised the bound

    clock.now += pending_module.RETRY_FIRST_S
    on_shm = shm.infer_requests
    assert client.infer("m", {"x": x}, outputs={"y": y})["y"] is y
    # By reference again: every tensor in a region, on the shm socket.
    assert client.last_transport == "shm" and shm.infer_requests == on_shm + 1
    assert shm.registered == ["big", "big"]
    regions = client.shm_regions
    assert regions["registered"] == 1 and regions["pending"] == []
    client.infer("m", {"x": x})  # output as a frame: the infer socket, x by reference
    assert infer_socket.sent[-1] == ("region", "frame")


def test_register_region_tries_a_pending_region_at_once_and_says_why_it_failed(
    client: InferenceClient, shm: ShmDaemon, clock: Clock
) -> None:
    big = client.shared_region(8192, label="big")
    x, y = big.array(2, np.float32), big.array(2, np.float32)
    _served_on_shm(client, x, y)
    _restart_found_on_shm(client, shm, x, y)
    client.infer("m", {"x": x}, outputs={"y": y})  # failed once, put off
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        client.register_region(big)  # asked for by name: tried now, and its error raised
    assert shm.refused == ["big", "big"]
    assert client.shm_regions["pending"][0]["failures"] == 2
    shm.refuse = lambda label: None
    client.register_region(big)
    assert client.shm_regions == {"registered": 1, "pending": [], "failed_registrations": 2}


def test_last_transport_names_the_socket_a_call_that_timed_out_was_sent_on(
    client: InferenceClient, shm: ShmDaemon
) -> None:
    region = client.shared_region(8192)
    x, y = region.array(2, np.float32), region.array(2, np.float32)
    _served_on_shm(client, x, y)
    with pytest.raises(RequestTimeout):
        client.infer("slow", {"x": np.ones(2, np.float32)}, timeout=0.1)
    assert client.last_transport == "infer"  # before: "shm", the call before's
