"""``alerts.mavlink_endpoint`` is checked at load by the rule the MAVLink hook opens
it with, so nothing passes ``check-config`` that the hook then refuses.

The config had a rule of its own: ``udpout:a[b:14550`` and ``udpout:gcs]x:14550``
loaded, then the hook refused them at start and was left out (an ERROR line), and
a zone id that can name no interface (``%eth/0``, a space, 16 characters) loaded
too (review F8, ``r2_endpoints.py``).  A zone id naming no interface present now
still loads: the hook says ``unreachable`` until the interface appears (a USB
radio's may come up after the daemon; ``check-config`` may run on another host).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd import config
from inferd.alerts.interface import AlertHookUnavailableError
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.config.mavlink_endpoint import endpoint_problem, split_host_port
from inferd.errors import ConfigError


def _ipv6() -> bool:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close()
    except OSError:  # a kernel without IPv6
        return False
    return True


def load_with_endpoint(tmp_path: Path, endpoint: str) -> config.Config:
    """A config whose only alert hook endpoint is ``endpoint`` (``ConfigError`` if refused)."""
    return config.from_mapping(
        {
            "daemon": {"state_dir": str(tmp_path)},
            "models": [{"name": "m", "path": "m.onnx"}],
            "alerts": {"mavlink_endpoint": endpoint},
        },
        source="test",
        base_dir=tmp_path,
    )


@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("udpout:a[b:14550", "an IPv6 address goes in brackets"),
        ("udpout:gcs]x:14550", "an IPv6 address goes in brackets"),
        ("tcp:a]b:5760", "an IPv6 address goes in brackets"),
        ("udpout:[fe80::1%eth/0]:14550", "Unexpected '/'"),  # ipaddress's own refusal
        ("udpout:[fe80::1%a b]:14550", "not an interface name"),
        ("udpin:[fe80::1%abcdefghijklmnop]:14550", "at most 15 characters"),
        ("udpout:[fe80::1%..]:14550", "not an interface name"),
        ("udpout:[fe80::1%eth\u00e9]:14550", "printable ASCII"),
    ],
)
def test_an_endpoint_the_hook_cannot_use_is_refused_at_load_saying_why(
    tmp_path: Path, endpoint: str, why: str
) -> None:
    with pytest.raises(ConfigError, match=rf"alerts\.mavlink_endpoint: .*\(port 1\.\.65535.*{why}"):
        load_with_endpoint(tmp_path, endpoint)


@pytest.mark.parametrize(
    "endpoint",
    [
        "udpout:[fe80::1%eth0]:14550",
        "udpout:[fe80::1%nosuchif0]:14550",  # the hook says unreachable until it appears
        "udpout:[fe80::1%2]:14550",  # an interface index
        "udpin:[fe80::1%wlan0]:14550",
        "tcp:[fe80::1%usb0]:5760",
        "udpout:[::1]:00080",
    ],
)
def test_a_zone_id_that_can_name_an_interface_loads(tmp_path: Path, endpoint: str) -> None:
    assert load_with_endpoint(tmp_path, endpoint).alerts.mavlink_endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    [
        "udpout:127.0.0.1:14550",
        "udpout:[::1]:14550",
        "udpout:[fe80::1%nosuchif0]:14550",
        "udpout:ground-station.example:14550",
        "udpout:a[b:14550",
        "udpout:gcs]x:14550",
        "udpout:[fe80::1%eth/0]:14550",
        "udpout:[gcs]:14550",
        "udpout:::1:14550",
        "udpout:[::1]:65536",
    ],
)
def test_the_config_loads_exactly_the_udpout_endpoints_the_hook_opens(
    tmp_path: Path, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_dns(name: str) -> str:  # the name's thread: no resolver needed here
        raise OSError("no resolver in this test")

    monkeypatch.setattr("socket.gethostbyname", no_dns)
    if "[" in endpoint and not _ipv6():
        pytest.skip("no IPv6 sockets here")
    try:
        load_with_endpoint(tmp_path, endpoint)
    except ConfigError:
        loads = False
    else:
        loads = True
    try:
        with capture_logs():
            hook = MavlinkAlertHook(endpoint)
    except AlertHookUnavailableError:
        opens = False
    else:
        opens = True
        with capture_logs():
            hook.close()
    assert loads == opens, (endpoint, loads, opens)


# A link-local IPv6 ground station (fe80::/10) without its interface (%eth0) is
# refused at load, saying what to write: ``udpout:[fe80::1]:14550`` loaded, the
# link's route lookup failed EINVAL for it, so it read ``unreachable`` forever
# while every send went out of whichever interface the kernel picked (DESIGN 308).


@pytest.mark.parametrize(
    "endpoint",
    ["udpout:[fe80::1]:14550", "udpin:[fe80::10]:14550", "tcp:[fe80::1]:5760", "udp:[febf::1]:1"],
)
def test_a_link_local_address_without_its_interface_is_refused_at_load(
    tmp_path: Path, endpoint: str
) -> None:
    with pytest.raises(ConfigError, match=r"link-local address needs %<interface>"):
        load_with_endpoint(tmp_path, endpoint)
    assert "[fe80::1%eth0]:14550" in str(endpoint_problem(endpoint))  # what to write instead


@pytest.mark.parametrize(
    "address",
    ["[fe80::1%eth0]:14550", "[fe80::1%2]:14550", "[fec0::1]:14550", "[fd00::1]:14550", "[::]:1"],
)
def test_a_link_local_address_with_its_interface_and_any_other_address_still_load(
    address: str,
) -> None:
    assert split_host_port(address)[1] == int(address.rpartition(":")[2])
    assert endpoint_problem(f"udpout:{address}") is None
