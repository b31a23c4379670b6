"""A registration that timed out and that the daemon made late is the region's
registration: the retry adopts it and never registers the region twice.

Before (review RD, finding 1): the channel read the late reply only after it had
sent the retry's registration, so the daemon held two copies of the region at
once; with a bound that holds one copy (``shm.max_bytes_per_uid`` 1.5x the
region, ``max_regions_per_connection``), the retry was refused
``RESOURCE_EXHAUSTED`` by the client's own orphan copy, counted as a failure,
and its next try put off twice as long.  Now the replies already queued are
read, without waiting, before a registration is sent: a late success for the
region being registered is taken as its registration (nothing is sent), one for
any other region is unregistered first.  A late success that comes while the
retry waits is taken too, over the retry's refusal.

The daemon is played by ``test_pending_regions``' scripted ``shm.sock``, with a
bound of one live region, and answers held back until the test lets them go."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from inferd_client import InferenceClient, RequestTimeout, SharedRegion
from inferd_wire import protocol
from tests.conftest import wait_until
from tests.unit.client.scripted import Script
from tests.unit.client.test_pending_regions import InferSocket, ShmDaemon

#: The client's timeout: each registration that is held back waits this long.
TIMEOUT_S = 0.2


class BoundedShmDaemon(ShmDaemon):
    """A ``ShmDaemon`` that holds ``max_live`` regions at most (a bound that holds
    one copy of a region, as ``shm.max_bytes_per_uid`` at 1.5x its size does)
    and, from ``hold()``, reads messages without answering them until
    ``answer_held()``, or until ``answer_at`` of them are held (then answered in
    order from its own thread: a daemon that was stopped and goes on)."""

    def __init__(self, path: str) -> None:
        self.max_live = 1
        self.unregistered: list[str] = []
        self._live: set[str] = set()  # the region ids held now
        self._answer_at: int | None = None
        self._holding = False
        self._held: list[tuple[socket.socket, bytes]] = []
        self._state = threading.Lock()
        super().__init__(path)
        self.refuse = self._bound

    def _bound(self, label: str | None) -> str | None:
        if len(self._live) < self.max_live:
            return None
        return f"{len(self._live)} regions held; one more would exceed the bound ({self.max_live})"

    def live(self) -> set[str]:
        with self._state:
            return set(self._live)

    def held(self) -> int:
        with self._state:
            return len(self._held)

    def hold(self, *, answer_at: int | None = None) -> None:
        with self._state:
            self._holding, self._answer_at = True, answer_at

    def answer_held(self) -> None:
        with self._state:
            self._answer_all()

    def _answer_all(self) -> None:
        held, self._held, self._holding = self._held, [], False
        for peer, data in held:
            self._answer_now(peer, data)

    def _answer(self, peer: socket.socket, data: bytes) -> None:
        with self._state:
            if not self._holding:
                self._answer_now(peer, data)
                return
            self._held.append((peer, data))
            if len(self._held) == self._answer_at:
                self._answer_all()

    def _answer_now(self, peer: socket.socket, data: bytes) -> None:
        header = protocol.unpack_header(data)
        registered = len(self.registered)
        super()._answer(peer, data)
        if header["op"] == "register" and len(self.registered) > registered:
            self._live.add(_id(len(self.registered)))
        elif header["op"] == "unregister":
            self.unregistered.append(header["region"])
            self._live.discard(header["region"])

    def restart(self) -> None:
        with self._state:
            self._live.clear()  # a restart releases every region
        super().restart()


def _id(n: int) -> str:
    """The id ``ShmDaemon`` gives its ``n``-th registration."""
    return f"{n:032x}"


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[BoundedShmDaemon]:
    daemon = BoundedShmDaemon(str(tmp_path / "shm.sock"))
    yield daemon
    daemon.close()


@pytest.fixture
def client(server: Callable[[Script], str], shm: BoundedShmDaemon) -> Iterator[InferenceClient]:
    with InferenceClient(server(InferSocket()), timeout=TIMEOUT_S, shm_socket=shm.path) as made:
        yield made


def test_a_pending_regions_late_registration_is_adopted_not_refused_by_its_own_copy(
    client: InferenceClient, shm: BoundedShmDaemon
) -> None:
    """The review's case: a pending region's try times out (the daemon stalled),
    the daemon makes it anyway, and the next try finds the late reply queued."""
    region = client.shared_region(4096, label="cam")
    shm.restart()  # the region is pending from the next use of the connection
    shm.hold()
    with pytest.raises(RequestTimeout):
        client.register_region(region)  # tried on a new connection: no answer
    assert client.shm_regions["pending"][0]["failures"] == 1
    wait_until(lambda: shm.held() == 1, message="the registration read by the daemon")
    shm.answer_held()  # the daemon goes on: registered late, its reply queued
    assert shm.live() == {_id(2)}

    # Before: the retry's registration was sent first and refused (RESOURCE_EXHAUSTED:
    # the late copy held the bound), counted, and put off 2 s.
    assert client.register_region(region) == _id(2)  # the late one, held once
    assert shm.registered == ["cam", "cam"] and shm.refused == []  # nothing sent again
    assert shm.unregistered == [] and shm.live() == {_id(2)}
    regions = client.shm_regions
    assert regions["registered"] == 1 and regions["pending"] == []
    assert regions["failed_registrations"] == 1  # the try that timed out, no other
    assert client.discarded_replies == 0  # adopted, not discarded


@pytest.mark.parametrize("room", [1, 2], ids=["room-for-one-copy", "room-for-two"])
def test_a_late_registration_that_comes_while_the_retry_waits_is_taken(
    client: InferenceClient, shm: BoundedShmDaemon, room: int
) -> None:
    """The retry is sent before the daemon made the first (it was still stopped),
    and both are answered in order while the retry waits.  With room for one
    copy the retry is refused, and the late one is the registration (before: the
    late one was let go and the refusal raised); with room for two, the retry's
    copy goes (before: the late one went, so either way one copy is held)."""
    client.shared_region(4096, label="open")  # the connection is up: _id(1)
    shm.max_live = 1 + room
    shm.hold(answer_at=2)
    with SharedRegion(4096, label="cam") as cam:
        with pytest.raises(RequestTimeout):
            client.register_region(cam)
        assert client.register_region(cam) == _id(2)  # the late registration
        if room == 1:
            assert shm.refused == ["cam"] and shm.unregistered == []
        else:
            wait_until(lambda: shm.unregistered == [_id(3)], message="the retry's copy let go")
            assert shm.refused == []
        assert shm.live() == {_id(1), _id(2)}
        assert client.shm_regions["registered"] == 2
