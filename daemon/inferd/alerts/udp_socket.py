"""The socket of a ``udp*:`` MAVLink endpoint, which the hook opens itself
(pymavlink's ``mavudp`` is IPv4 only): non-blocking, IPv6 for a bracketed address.

``udpin:`` / ``udp:`` binds it, without ``SO_REUSEADDR`` (pymavlink set it): with
it, a process of another local user could bind a more specific address on the
same port (Linux makes no uid check for UDP) and take every datagram the ground
station sends.  UDP has no TIME_WAIT, so a restarted daemon binds again at once
without it.  ``IP_FREEBIND`` lets it bind an address not assigned yet (DHCP, a USB
radio's): it receives once the address is up.  A bind that still fails for want of
the address or its interface (``no_route``: a zone id naming no interface,
``EADDRNOTAVAIL``, ``ENODEV``) leaves the socket unbound and says why
(``bind_error``); the link tries ``bind`` again (``UdpPeers``).  Anything else
(``EADDRINUSE``, ``EACCES``) raises, and the hook is refused.

``udpout:`` sets ``SO_BROADCAST``: a broadcast address (``255.255.255.255``, a
subnet's) is a common way to reach a ground station on a radio LAN, and without
it the kernel refuses every datagram to one with ``EACCES``.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from inferd.config.mavlink_endpoint import split_host_port

#: What ``sendto`` fails with while there is no route or interface to the address
#: (``bind`` too, for an address or interface that is not there).
NO_ROUTE_ERRNOS = frozenset(
    (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.ENODEV)
)
#: ``<linux/in.h>``'s, which Python does not name; taken by IPv6 sockets too.
IP_FREEBIND = 15


def no_route(exc: OSError) -> bool:
    """Whether a send (a bind) failed for want of a route, an address or an
    interface (a zone id's ``gaierror``), not because the kernel refused it."""
    return isinstance(exc, socket.gaierror) or exc.errno in NO_ROUTE_ERRNOS


def sockaddr(host: str, port: int) -> tuple[Any, ...]:
    """The address to hand ``sendto``/``bind``: an IPv6 one with its zone id as
    the interface's index (``gaierror`` while no interface has that name)."""
    if ":" not in host:
        return (host, port)
    flags = socket.AI_NUMERICHOST
    return socket.getaddrinfo(host, port, socket.AF_INET6, socket.SOCK_DGRAM, 0, flags)[0][4]


def why_missing(host: str, exc: OSError) -> str:
    """What ``exc``, a ``no_route`` error about ``host``, says: for a zone id
    (``fe80::1%radio0``) that no interface of that name is there; for a zone index
    (``fe80::1%7``, passed to the kernel as it is) that no interface has it."""
    zone = host.partition("%")[2]
    if zone and isinstance(exc, socket.gaierror):
        return f"no network interface named {zone!r} ({exc!r})"
    if zone.isdigit() and exc.errno == errno.ENODEV:  # the bind's, for the index
        return f"no network interface with index {zone} ({exc!r})"
    return repr(exc)


class UdpSocket:
    """The socket (``port``, as pymavlink's ``mavudp`` names it) of a ``udpin:``/``udp:``
    (bound, or ``bind_error`` saying why not yet) or ``udpout:`` endpoint."""

    def __init__(self, endpoint: str) -> None:
        kind, _, address = endpoint.partition(":")
        if kind not in ("udpin", "udp", "udpout"):
            raise ValueError(f"{endpoint!r} is not a udpin:, udp: or udpout: endpoint")
        self.host, self._port_number = split_host_port(address)
        self.udp_server = kind != "udpout"
        #: Why the ``udpin:`` socket is not bound yet (``bind``); None once it is.
        self.bind_error: str | None = None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self.port = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.port.setblocking(False)
            if self.udp_server:
                self.port.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
                self.bind()
            else:
                self.port.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        except BaseException:
            self.port.close()
            raise
        self.destination_addr = None if self.udp_server else (self.host, self._port_number)

    def bind(self) -> str | None:
        """Bind the ``udpin:`` socket; why it cannot yet (kept in ``bind_error``),
        None once bound.  Raises any other ``OSError``."""
        try:
            self.port.bind(sockaddr(self.host, self._port_number))
        except OSError as exc:
            if not no_route(exc):
                raise
            self.bind_error = f"cannot bind it yet: {why_missing(self.host, exc)}"
            return self.bind_error
        self.bind_error = None
        return None

    def close(self) -> None:
        self.port.close()
