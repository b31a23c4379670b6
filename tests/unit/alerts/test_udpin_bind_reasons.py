"""Why a ``udpin:`` MAVLink link is not bound, in words and in the log (review RB's
minor notes on DESIGN.md 328), over real UDP sockets on loopback.

A numeric zone index naming no interface (``udpin:[fe80::1%999]``) read only
"cannot bind it yet: OSError(19, 'No such device')"; a zone name's reads "no network
interface named ...".  And ``mavlink_udpin_not_bound`` was logged once, with the
first error: a later, different one (the port taken by another socket while the
interface was missing, ``EADDRINUSE``) showed in the link's status but never reached
the log.  Now each new reason is logged once (``mavlink_udpin_bind_error_changed``),
never once per retry."""

from __future__ import annotations

import errno
import socket
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import udp_link
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.alerts.udp_socket import why_missing
from tests.conftest import wait_until
from tests.unit.alerts.test_udp_link_review5 import Interface, _close, _port

NO_SUCH_DEVICE = OSError(errno.ENODEV, "No such device")


def test_a_zone_index_naming_no_interface_is_said_so() -> None:
    assert why_missing("fe80::1%999", NO_SUCH_DEVICE) == (
        "no network interface with index 999 (OSError(19, 'No such device'))"
    )
    # A zone name's own words, and an error that is not the index's, are as they were.
    gone = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert why_missing("fe80::1%radio0", gone).startswith("no network interface named 'radio0'")
    assert why_missing("fe80::1%radio0", NO_SUCH_DEVICE) == repr(NO_SUCH_DEVICE)
    assert why_missing("192.0.2.1", NO_SUCH_DEVICE) == repr(NO_SUCH_DEVICE)


def test_a_udpin_link_on_a_zone_index_naming_no_interface_reads_why() -> None:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with pytest.raises(OSError):
        socket.if_indextoname(999)  # the index names no interface here
    with capture_logs() as logs:
        hook = MavlinkAlertHook("udpin:[fe80::1%999]:0")
    try:
        link = hook.status()
        assert link["state"] == "unreachable"
        assert str(link["error"]).startswith(
            "cannot bind it yet: no network interface with index 999"
        )  # before: "cannot bind it yet: OSError(19, 'No such device')"
        (line,) = [line for line in logs if line["event"] == "mavlink_udpin_not_bound"]
        assert "no network interface with index 999" in line["error"]
    finally:
        _close(hook)


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 here")
def test_a_port_taken_while_unbound_is_logged_once_not_at_each_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    interface = Interface(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", interface)
    monkeypatch.setattr(udp_link, "NO_ROUTE_RETRY_S", 0.01)  # no 1 s waits
    try:
        holder = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        holder.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    port = holder.getsockname()[1]
    with capture_logs() as opened:
        hook = MavlinkAlertHook(f"udpin:[{Interface.HOST}]:{port}")
    peers = hook._peers
    assert peers is not None
    tries: list[str | None] = []
    bind = peers._bind
    assert bind is not None

    def counted() -> Any:
        tries.append(None)
        return bind()

    peers._bind = counted
    try:
        (first,) = [line for line in opened if line["event"] == "mavlink_udpin_not_bound"]
        assert "no network interface named 'radio0'" in first["error"]
        with capture_logs() as logs:
            interface.plug()  # there now, but another socket took the port meanwhile
            wait_until(lambda: "Address already in use" in str(hook.status()["error"]))
            seen = len(tries)
            wait_until(lambda: len(tries) >= seen + 5, message="five more tries")
        changed = [line for line in logs if line["event"] == "mavlink_udpin_bind_error_changed"]
        assert len(changed) == 1, logs  # before: none; and never one per retry
        assert changed[0]["error"].startswith("cannot bind it: OSError(98, ")
        assert changed[0]["previous"] == first["error"]
        assert changed[0]["endpoint"] == f"udpin:[{Interface.HOST}]:{port}"
        with capture_logs() as logs:
            holder.close()
            wait_until(lambda: hook.status()["state"] == "no_peer", message="the link bound")
        assert [line["event"] for line in logs] == ["mavlink_udpin_bound"]
        assert _port(hook) == port
    finally:
        holder.close()
        _close(hook)
