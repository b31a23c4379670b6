"""Review R1 of the alert links (session 12), F1-F3, over real UDP sockets on loopback.

F1: a ``udpin:`` socket set ``SO_REUSEADDR``, so a process of another local user
could bind ``127.0.0.1`` on the same port next to the hook's ``0.0.0.0`` and take
every heartbeat (Linux makes no uid check for UDP; sharing is per socket, so a
second socket of this process proves it).  Now its bind fails ``EADDRINUSE``, and
the hook still binds the port again at once after a close (UDP has no TIME_WAIT).

F2: a ``udpin:`` address not assigned yet (``EADDRNOTAVAIL``) or a zone id naming
no interface refused the hook for the whole run, and a refused hook had no
``inferd_alerts_link_up`` series.  Now ``IP_FREEBIND`` binds the address, a bind
that still fails opens the hook ``unreachable`` (holding alerts, bound by the
link's thread once the interface is there), and a refused link hook reads 0.

F3: ``udpout:`` to a broadcast address read ``up`` while every send failed
``EACCES``.  Now ``SO_BROADCAST`` is set, and a route probe's ``EACCES`` is not ``up``.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher, build_alert_hooks, udp_link
from inferd.alerts.interface import AlertHookUnavailableError
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.config import AlertsConfig
from inferd.metrics import families
from inferd.types import Alert
from tests.conftest import HANG_S, wait_until
from tests.unit.alerts.test_mavlink_udpin import _heartbeat, _text

#: The loopback network's broadcast address (``ip route show table local``).
LOOPBACK_BROADCAST = "127.255.255.255"
#: TEST-NET-2 (RFC 5737): an address no host here has.
UNASSIGNED = "198.51.100.77"


@pytest.fixture
def ipv6() -> None:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.bind(("::1", 0))
    except OSError as exc:  # a kernel without IPv6, or no ::1
        pytest.skip(f"no IPv6 loopback here: {exc}")


def _port(hook: MavlinkAlertHook) -> int:
    return int(hook._connection.port.getsockname()[1])


def _close(*hooks: MavlinkAlertHook) -> None:
    with capture_logs():  # held alerts dropped at close
        for hook in hooks:
            hook.close()


# -- F1 ------------------------------------------------------------------------


def test_no_other_socket_can_bind_the_udpin_port_and_a_closed_hook_binds_it_again_at_once() -> None:
    hook = MavlinkAlertHook("udpin:0.0.0.0:0")
    port = _port(hook)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as thief:
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as refused:
                thief.bind(("127.0.0.1", port))  # before: bound, and took the heartbeats
            assert refused.value.errno == errno.EADDRINUSE
    finally:
        _close(hook)
    again = MavlinkAlertHook(f"udpin:0.0.0.0:{port}")  # a restarted daemon
    try:
        assert _port(again) == port
        assert again.status()["state"] == "no_peer"
    finally:
        _close(again)


# -- F2 ------------------------------------------------------------------------


def test_a_udpin_address_not_assigned_yet_is_bound_all_the_same() -> None:
    config = AlertsConfig(hooks=("mavlink",), mavlink_endpoint=f"udpin:{UNASSIGNED}:14550")
    refused: dict[str, str] = {}
    hooks = build_alert_hooks(
        config, events=lambda *_: None, record=None, on_refused=refused.__setitem__
    )
    try:
        assert refused == {}  # before: "Cannot assign requested address", for the whole run
        (hook,) = hooks
        assert isinstance(hook, MavlinkAlertHook)
        assert hook._connection.port.getsockname()[0] == UNASSIGNED
        assert hook.status()["state"] == "no_peer"
    finally:
        for hook in hooks:
            hook.close()


@pytest.mark.usefixtures("ipv6")
def test_a_udpin_zone_id_naming_no_interface_opens_unreachable_and_holds_its_alerts() -> None:
    config = AlertsConfig(hooks=("mavlink",), mavlink_endpoint="udpin:[fe80::1%nosuchif0]:14550")
    refused: dict[str, str] = {}
    with capture_logs() as logs:
        hooks = build_alert_hooks(
            config, events=lambda *_: None, record=None, on_refused=refused.__setitem__
        )
    assert refused == {}  # before: refused ("Name or service not known")
    (hook,) = hooks
    assert isinstance(hook, MavlinkAlertHook)
    dispatcher = AlertDispatcher([hook], rate_limit_s=0)
    try:
        link = hook.status()
        assert (link["state"], link["destinations"]) == ("unreachable", 0), link
        assert "no network interface named 'nosuchif0'" in str(link["error"])
        (line,) = [line for line in logs if line["event"] == "mavlink_udpin_not_bound"]
        assert line["endpoint"] == config.mavlink_endpoint
        with capture_logs():
            dispatcher(Alert("ERROR", "fdr_unavailable", "recorder down"))
        status = dispatcher.status()["hooks"]["mavlink"]
        assert (status["sent"], status["failures"], status["link"]["waiting"]) == (0, 1, 1)
        assert "nosuchif0" in str(status["last_error"])
    finally:
        with capture_logs():
            dispatcher.close()


class Interface:
    """``socket.getaddrinfo`` as the kernel answers for ``fe80::1%radio0``: no such
    interface (``gaierror``) until ``plug()``, then an address the test can reach
    (``::1``); every other host answered by the real one."""

    HOST = "fe80::1%radio0"

    def __init__(self, real: Any) -> None:
        self._real = real
        self.plugged = False

    def plug(self) -> None:
        self.plugged = True

    def __call__(self, host: Any, *args: Any, **kwargs: Any) -> Any:
        if host != self.HOST:
            return self._real(host, *args, **kwargs)
        if not self.plugged:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self._real("::1", *args, **kwargs)


@pytest.mark.usefixtures("ipv6")
def test_a_udpin_link_binds_once_its_interface_appears_and_sends_what_it_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    interface = Interface(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", interface)
    monkeypatch.setattr(udp_link, "NO_ROUTE_RETRY_S", 0.01)  # no 1 s waits
    with capture_logs():
        hook = MavlinkAlertHook(f"udpin:[{Interface.HOST}]:0")
    station = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    station.bind(("::1", 0))
    station.settimeout(HANG_S)
    try:
        with capture_logs(), pytest.raises(ConnectionError, match="held, sent late"):
            hook.alert("CRITICAL", "model_unavailable", "no engine", {})
        assert hook.status()["state"] == "unreachable"
        with capture_logs() as logs:
            interface.plug()  # the USB radio comes up
            wait_until(lambda: hook.status()["state"] == "no_peer", message="the link bound")
        assert [line["event"] for line in logs] == ["mavlink_udpin_bound"]
        with capture_logs():
            station.sendto(_heartbeat(), ("::1", _port(hook)))
            text = _text(station.recv(512))
        assert re.fullmatch(r"model_unavailable: no engine \(\d+ s late\)", text), text
        assert hook.status()["state"] == "up"
    finally:
        _close(hook)
        station.close()


@pytest.mark.usefixtures("ipv6")
def test_a_port_taken_while_the_interface_was_missing_is_said_and_bound_once_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    interface = Interface(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", interface)
    monkeypatch.setattr(udp_link, "NO_ROUTE_RETRY_S", 0.01)
    holder = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    holder.bind(("::1", 0))
    port = holder.getsockname()[1]
    with capture_logs():
        hook = MavlinkAlertHook(f"udpin:[{Interface.HOST}]:{port}")
    try:
        interface.plug()  # there now, but another process took the port meanwhile
        wait_until(
            lambda: "Address already in use" in str(hook.status()["error"]),
            message="the taken port said",
        )
        assert hook.status()["state"] == "unreachable"
        with capture_logs():
            holder.close()
            wait_until(lambda: hook.status()["state"] == "no_peer", message="the link bound")
        assert _port(hook) == port
    finally:
        holder.close()
        _close(hook)


def test_a_refused_link_hook_reads_down_in_the_metrics_and_one_without_a_link_not() -> None:
    refused = {"mavlink": "pymavlink is not installed", "fdr": "no flight data recorder"}
    alerts = {"raised": 0, "sent": 0, "suppressed": 0, "hooks": {}, "refused_hooks": refused}
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.SECTIONS["alerts"]({"alerts": alerts}, {})
        for sample in family.samples
    }
    up = {
        labels: value
        for (name, labels), value in samples.items()
        if name == "inferd_alerts_link_up"
    }
    assert up == {(("hook", "mavlink"),): 0}  # before: no series, the pre-flight rule silent


def test_a_hook_refused_for_another_reason_is_still_refused() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        with pytest.raises(AlertHookUnavailableError, match="Address already in use"):
            MavlinkAlertHook(f"udpin:127.0.0.1:{taken.getsockname()[1]}")


# -- F3 ------------------------------------------------------------------------


@pytest.fixture
def broadcast_listener() -> Iterator[socket.socket]:
    """A ground station listening on every address: a broadcast reaches it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as plain:
        try:  # what every udpout: socket got before: refused
            plain.sendto(b"", (LOOPBACK_BROADCAST, 9))
        except PermissionError:
            pass
        else:
            pytest.skip(f"{LOOPBACK_BROADCAST} is no broadcast address here")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    sock.settimeout(HANG_S)
    yield sock
    sock.close()


def test_a_udpout_link_to_a_broadcast_address_is_up_and_its_alerts_are_sent(
    broadcast_listener: socket.socket,
) -> None:
    hook = MavlinkAlertHook(f"udpout:{LOOPBACK_BROADCAST}:{broadcast_listener.getsockname()[1]}")
    dispatcher = AlertDispatcher([hook], rate_limit_s=0)
    try:
        assert hook.status()["state"] == "up"
        with capture_logs():
            dispatcher(Alert("CRITICAL", "engine_worker_died", "engine failed"))
        status = dispatcher.status()["hooks"]["mavlink"]
        assert (status["sent"], status["failures"]) == (1, 0), status  # before: (0, 1), EACCES
        assert _text(broadcast_listener.recv(512)) == "engine_worker_died: engine failed"
    finally:
        dispatcher.close()


def test_a_route_probe_the_kernel_refuses_eacces_reads_unreachable_not_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuses(family: int, address: tuple[Any, ...]) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(udp_link, "_probe_route", refuses)
    with capture_logs() as logs:
        hook = MavlinkAlertHook("udpout:127.0.0.1:14550")
    try:
        link = hook.status()
        assert link["state"] == "unreachable", link  # before: "up"
        assert "Permission denied" in str(link["error"])
        assert [line["event"] for line in logs] == ["mavlink_udp_no_route"]
    finally:
        _close(hook)
