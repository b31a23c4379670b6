"""The Python request channel after an interrupted renewal, and a refusal met
while no call waited (review R2 of DESIGN.md 318 and 322, F1 and F2).

F1: ``RequestChannel._renew`` closed the watch and the socket, then made new
ones; an exception a signal handler raised in between (a watchdog's, Ctrl-C)
left the channel on its closed socket, and every later call of a client the
caller never closed raised ``ClientError: the client is closed``.

F2: a refusal read before the send (met at construction, or while idle) raised
``ConnectionRefused`` at once for a call that never tried, even when the daemon
had room by then.  Only a refusal of the connection a call waits for fails it.

``Interrupted`` stands for what a handler raises: a ``BaseException``, as
``KeyboardInterrupt`` is, but not one pytest stops on."""

from __future__ import annotations

import select
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

import inferd_client.channel as channel_module
from inferd_client import ClientError, ConnectionRefused, OperatorClient
from inferd_client.channel import RequestChannel
from inferd_client.connection_watch import ConnectionWatch
from tests.conftest import HANG_S, wait_until
from tests.unit.client.guarded import Guarded, guarded_peers
from tests.unit.client.scripted import Script, answer_ok

#: What ``answer_ok`` answers.
SERVED = {"done": True}


class Interrupted(BaseException):
    """What a signal handler raised inside the channel's renewal."""


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[Callable[[list[str]], Guarded]]:
    """``guarded(answers)``: a new ``Guarded`` ROUTER on the test's endpoint."""
    yield from guarded_peers(f"ipc://{tmp_path}/control.sock")


def channel_of(client: OperatorClient) -> RequestChannel:
    channel: RequestChannel = client._channel
    return channel


def news_pending(client: OperatorClient) -> bool:
    """Whether news waits on the client's monitor, looked at with ``poll(2)`` on its
    descriptor alone: a look through libzmq (``Socket.poll``) would take the edge the
    watch waits for."""
    looking = select.poll()
    looking.register(int(channel_of(client)._watch.monitor.get(zmq.FD)), select.POLLIN)
    return bool(looking.poll(0))


def interrupt_once(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, after: bool
) -> list[int]:
    """``owner.name`` raises ``Interrupted`` at its next call, once: before it does
    anything (``after`` False) or once it has done it (``after`` True).  The count
    raised so far is returned."""
    real = getattr(owner, name)
    raised = [0]

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if raised[0]:
            return real(*args, **kwargs)
        raised[0] += 1
        if after:
            real(*args, **kwargs)
        raise Interrupted(f"a handler's exception in {name}")

    monkeypatch.setattr(owner, name, interrupted)
    return raised


@pytest.mark.parametrize("cause", ["sending", "refused"])
def test_a_renewal_interrupted_before_a_send_leaves_the_next_call_served(
    server: Callable[[Script], str], monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    # A send cut short between its parts (DESIGN.md 318), or a refused connection
    # (322): the next call makes the socket anew, and is interrupted in ``connect``.
    endpoint = server(answer_ok)
    with OperatorClient(endpoint, timeout=HANG_S) as client:
        assert client.call("status") == SERVED
        channel = channel_of(client)
        setattr(channel, f"_{cause}", True)
        raised = interrupt_once(monkeypatch, channel_module, "connect", after=False)
        with pytest.raises(Interrupted):
            client.call("status")
        assert raised == [1]
        # Before: "ClientError: the client is closed", on every later call.
        assert client.call("status") == SERVED
        assert client.call("status") == SERVED


@pytest.mark.parametrize(
    ("owner", "name", "after"),
    [
        (channel_module, "connect", False),  # inside the new socket's making
        (ConnectionWatch, "close", True),  # between the old watch's close and the socket's
    ],
    ids=["in-connect", "between-closes"],
)
def test_a_renewal_after_a_lost_connection_interrupted_leaves_the_next_call_served(
    guarded: Callable[[list[str]], Guarded],
    monkeypatch: pytest.MonkeyPatch,
    owner: Any,
    name: str,
    after: bool,
) -> None:
    daemon = guarded(["200"])
    with OperatorClient(daemon.endpoint, timeout=HANG_S) as client:
        assert client.call("status") == SERVED
        daemon.close()  # a daemon that stopped: the connection ends
        wait_until(lambda: news_pending(client), message="the client's news of the end")
        guarded(["200"])  # and started again
        raised = interrupt_once(monkeypatch, owner, name, after=after)
        with pytest.raises(Interrupted):
            client.call("status")  # reads the end, makes the socket anew: interrupted
        assert raised == [1]
        assert client.connections_lost == 1
        assert client.call("status") == SERVED
        assert client.call("status") == SERVED


def test_a_closed_client_stays_closed(server: Callable[[Script], str]) -> None:
    client = OperatorClient(server(answer_ok), timeout=HANG_S)
    assert client.call("status") == SERVED
    channel_of(client)._sending = True  # would make a socket anew, were it open
    client.close()
    for _ in range(2):
        with pytest.raises(ClientError, match="the client is closed"):
            client.call("status")


def refusal_read(client: OperatorClient) -> int:
    """The status of the refusal the client's watch read while no call waited (the
    test reads the news as a call would, so that it is there when the call begins)."""
    watch = channel_of(client)._watch

    def read() -> int:
        watch.check()
        return watch.refused or 0

    return wait_until(read, message="the refusal read")


def test_a_refusal_met_while_idle_fails_no_call(
    guarded: Callable[[list[str]], Guarded],
) -> None:
    # The client's connection is refused while no call waits; then the daemon has
    # room.
    daemon = guarded(["400", "200"])
    with OperatorClient(daemon.endpoint, timeout=HANG_S) as client:
        assert refusal_read(client) == 400
        # Before: ConnectionRefused at once, and no handshake tried.
        assert client.call("status") == SERVED
        assert daemon.answered == ["400", "200"]  # connected anew, once
        assert client.call("status") == SERVED


def test_a_refusal_of_the_connection_a_call_waits_for_still_fails_it(
    guarded: Callable[[list[str]], Guarded],
) -> None:
    daemon = guarded(["400"])
    with OperatorClient(daemon.endpoint, timeout=HANG_S) as client:
        assert refusal_read(client) == 400  # met while idle: the call connects anew ...
        with pytest.raises(ConnectionRefused) as refused:
            client.call("status")  # ... and that connection is refused too
        assert refused.value.status == 400
        assert daemon.answered == ["400", "400"]


def monitor_message(event: int, value: int) -> list[bytes]:
    """A message as a libzmq monitor sends it: event (16 bits) and value (32), endpoint."""
    return [struct.pack("=HI", event, value), b"ipc:///a/b.sock"]


@pytest.mark.parametrize(
    ("events", "refused"),
    [
        ([(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400), (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)], None),
        ([(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0), (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)], 400),
    ],
    ids=["refused-then-admitted", "admitted-then-refused"],
)
def test_a_refusal_libzmq_tried_again_and_got_admitted_is_forgotten(
    tmp_path: Path, events: list[tuple[int, int]], refused: int | None
) -> None:
    # libzmq tries a refused connection once more: admitted, the connection is up
    # and the refusal is stale (a call would make a live connection anew for it).
    context: zmq.Context[Any] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    watch = ConnectionWatch(sock, f"ipc://{tmp_path}/none.sock", reconnect=False)
    real_monitor = watch.monitor
    fake_monitor = context.socket(zmq.PAIR)
    feeder = context.socket(zmq.PAIR)
    try:
        fake_monitor.bind("inproc://fake-monitor")
        feeder.connect("inproc://fake-monitor")
        watch.monitor = fake_monitor
        for event, value in events:
            feeder.send_multipart(monitor_message(int(event), value))
        assert fake_monitor.poll(int(HANG_S * 1000))
        assert watch.check() == 0
        assert watch.refused == refused
    finally:
        watch.monitor = real_monitor
        watch.close()
        for each in (sock, fake_monitor, feeder):
            each.close(linger=0)
        context.term()


def test_the_renewal_drops_an_interrupted_requests_parts(
    server: Callable[[Script], str],
) -> None:
    # The renewal still does what DESIGN.md 318 made it for: a request sent half
    # way never completes with the next one's parts.
    seen: list[list[bytes]] = []

    def recording(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        seen.append(frames)
        answer_ok(sock, frames)

    with OperatorClient(server(recording), timeout=HANG_S) as client:
        channel = channel_of(client)
        channel._socket.send(msgpack.packb({"v": 1, "id": 1, "op": "old"}), zmq.SNDMORE)
        channel._sending = True
        assert client.call("status") == SERVED
    assert [msgpack.unpackb(frames[1])["op"] for frames in seen] == ["status"]
    assert all(len(frames) == 2 for frames in seen)
