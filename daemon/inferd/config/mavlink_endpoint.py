"""``alerts.mavlink_endpoint``'s ``HOST:PORT``: one rule for the config's check at
load and for the MAVLink hook that opens the endpoint (``alerts/udp_link.py``,
``alerts/mavlink.py``).  Two rules drifted: ``udpout:a[b:14550`` passed the
config, then the hook refused it at start and was left out (an ERROR line).

An IPv6 address goes in brackets (``[::1]:14550``: out of them, which colon
starts the port?) and nothing else does.  Its zone id (``[fe80::1%eth0]``) must
be a name an interface can have (or an interface index), and a link-local one
(``fe80::/10``) must have one: without it the datagrams left by whichever
interface the kernel picked, the link reading ``unreachable`` (its route lookup
says ``EINVAL``) while they went.  Whether that interface exists is the hook's
to say (``link.state`` ``unreachable`` until it does), not the config's, as a
USB radio's interface may appear after the daemon starts and ``inferd
check-config`` may run on another host.
"""

from __future__ import annotations

import ipaddress

#: The endpoint kinds the config allows (pymavlink's names).
KINDS = ("udpout", "udpin", "udp", "tcp")
#: Linux's ``IFNAMSIZ`` less its NUL: the longest interface name.
IFNAME_MAX = 15


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` as ``(host, port)``, brackets stripped
    (an IPv6 zone id kept: ``fe80::1%eth0``); port 0..65535.  ``ValueError``
    saying why for anything else."""
    host, _, port = address.rpartition(":")
    bare = host.removeprefix("[").removesuffix("]")
    if host == f"[{bare}]":
        try:  # only an IPv6 address goes in brackets
            ip = ipaddress.IPv6Address(bare)
        except ValueError as exc:
            raise ValueError(f"{address!r}: {exc}") from None
        if ip.scope_id is not None and (problem := zone_problem(ip.scope_id)) is not None:
            raise ValueError(f"{address!r}: {problem}")
        if ip.scope_id is None and ip.is_link_local:  # sent by whichever interface
            raise ValueError(
                f"{address!r}: a link-local address needs %<interface>, as [fe80::1%eth0]:14550"
            )
    elif any(char in host for char in ":[]"):
        raise ValueError(f"{address!r}: an IPv6 address goes in brackets, as [::1]:14550")
    if not bare or not (port.isascii() and port.isdigit() and len(port) <= 5):
        raise ValueError(f"{address!r} is not host:port")
    if int(port) >= 65536:
        raise ValueError(f"{address!r}: port {int(port)} is over 65535")
    return bare, int(port)


def zone_problem(zone: str) -> str | None:
    """Why ``zone`` (after ``%``) can name no interface, as Linux's
    ``dev_valid_name`` has it; None for a name it allows or an index."""
    if not zone.isascii() or not zone.isprintable():
        return f"zone id {zone!r} is not an interface name (printable ASCII)"
    if len(zone) > IFNAME_MAX or zone in (".", "..") or any(c in zone for c in "/: \t"):
        return (
            f"zone id {zone!r} is not an interface name (at most {IFNAME_MAX} characters, "
            "no '/', ':' or space)"
        )
    return None


def endpoint_problem(endpoint: str) -> str | None:
    """Why the config refuses ``endpoint``, or None: a kind of ``KINDS``, then
    ``HOST:PORT`` (``split_host_port``) with a port of 1..65535."""
    kind, _, address = endpoint.partition(":")
    if kind not in KINDS:
        return f"{kind!r} is not one of {list(KINDS)}"
    try:
        _, port = split_host_port(address)
    except ValueError as exc:
        return str(exc)
    return "port 0 is no port to send to" if port == 0 else None
