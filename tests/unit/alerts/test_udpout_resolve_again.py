"""``UdpOut`` resolves its ground station's name again: every ``refresh_interval_s``
and at once after a send the kernel refused, on its own thread, sending to the last
address meanwhile.  Before, a name was resolved once: a station whose address
changed (DHCP, a spare taking over the name) never got another alert."""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from inferd.alerts import udp_link
from inferd.alerts.udp_link import RESOLVE_THREAD_NAME, UdpOut
from tests.conftest import HANG_S, wait_until

NAME = "ground-station.example"
#: A datagram to it without SO_BROADCAST is refused by the kernel (EACCES).
REFUSED = "255.255.255.255"


class Resolver:
    """Each call recorded with its thread's name, then answered with the next answer
    the test gives (an address, or an exception to raise): one step at a time."""

    def __init__(self) -> None:
        self.calls: queue.Queue[str] = queue.Queue()
        self.answers: queue.Queue[str | Exception] = queue.Queue()

    def __call__(self, name: str) -> str:
        assert name == NAME
        self.calls.put(threading.current_thread().name)
        answer = self.answers.get(timeout=HANG_S)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def next_call(self) -> str:
        """The thread name of the next call, once it is made (it then waits)."""
        return self.calls.get(timeout=HANG_S)


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    """The hook's socket (pymavlink's ``udpout`` one: IPv4, non-blocking)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    yield sock
    sock.close()


def listener(ip: str, port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((ip, port))
    sock.settimeout(HANG_S)
    return sock


def outcome(link: UdpOut) -> str:
    try:
        link.write(b"alert")
    except ConnectionError:  # not resolved yet
        return "unresolved"
    except PermissionError:
        return "refused"
    return "sent"


def test_a_send_the_kernel_refuses_resolves_the_name_again_at_once_in_the_background(
    sock: socket.socket,
) -> None:
    station = listener("127.0.0.1")
    resolver = Resolver()
    link = UdpOut(sock, NAME, station.getsockname()[1], f"udpout:{NAME}", resolve=resolver)
    try:
        assert resolver.next_call() == RESOLVE_THREAD_NAME
        assert outcome(link) == "unresolved"
        resolver.answers.put(REFUSED)
        wait_until(lambda: outcome(link) == "refused", message="the first address used")
        # Long before REFRESH_INTERVAL_S: the refusal asked for it, on the link's thread.
        assert resolver.next_call() == RESOLVE_THREAD_NAME
        assert outcome(link) == "refused"  # the last address, sent to without waiting
        resolver.answers.put("127.0.0.1")
        wait_until(lambda: outcome(link) == "sent", message="the new address used")
        assert station.recv(64) == b"alert"
    finally:
        link.close()
        resolver.answers.put("127.0.0.1")  # a call asked for meanwhile ends at once
        station.close()


def test_the_name_is_resolved_again_periodically_and_its_new_address_used(
    sock: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(udp_link, "RETRY_INTERVAL_S", 0.0)  # each step is a call
    first = listener("127.0.0.1")
    port = first.getsockname()[1]
    second = listener("127.0.0.2", port)
    resolver = Resolver()
    with capture_logs() as logs:
        link = UdpOut(sock, NAME, port, f"udpout:{NAME}", resolve=resolver, refresh_interval_s=0.0)
        try:
            resolver.next_call()
            resolver.answers.put("127.0.0.1")
            resolver.next_call()  # the next one, made once that answer was stored
            assert outcome(link) == "sent" and first.recv(64) == b"alert"
            resolver.answers.put("127.0.0.2")  # the station moved
            resolver.next_call()
            assert outcome(link) == "sent" and second.recv(64) == b"alert"
            resolver.answers.put(socket.gaierror(socket.EAI_AGAIN, "Temporary failure"))
            resolver.next_call()
            assert outcome(link) == "sent" and second.recv(64) == b"alert"  # kept
        finally:
            link.close()
            resolver.answers.put("127.0.0.2")
            first.close()
            second.close()
    moved = [line for line in logs if line["event"] == "mavlink_udpout_readdressed"]
    assert [(line["previous"], line["address"]) for line in moved] == [("127.0.0.1", "127.0.0.2")]
