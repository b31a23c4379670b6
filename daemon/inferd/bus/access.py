"""Who may connect to which socket, and who is an operator: the decision the ZAP
handler (``bus/zap.py``) asks for at each connection's handshake.

On ``ipc://`` the identity is the kernel's: libzmq reads ``SO_PEERCRED`` when
the connection is accepted and hands it to ZAP as the address
``<host>:<uid>:<gid>:<pid>``.  Group principals match the peer's gid or the
groups its user belongs to in the group database (``getgrouplist``).  On
``tcp://`` the identity is the name of the allow-listed CURVE client key the
handshake proved, or nothing but the address without CURVE (loopback only; such
a peer never passes an allow-list and is never an operator, and is counted and
rate limited by ``Peer.key``: its address, an IPv6 one's /64).  Root and the
daemon's own user pass every allow-list and are always operators: they can
already signal, trace or replace the daemon (DESIGN.md 60).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from inferd.config import Principal, SecurityConfig
from inferd.types import Peer

GroupsOf = Callable[[int, int], frozenset[int]]


def groups_of(uid: int, gid: int) -> frozenset[int]:
    """``gid`` and the groups the group database gives ``uid``'s user."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return frozenset({gid})
    return frozenset({gid, *os.getgrouplist(name, gid)})


def user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


@dataclass(frozen=True)
class Decision:
    """A connection admitted as ``peer``, or refused for ``refusal``."""

    peer: Peer | None
    refusal: str | None = None


class AccessPolicy:
    def __init__(
        self,
        security: SecurityConfig,
        transports: Mapping[str, str],
        curve_clients: Mapping[bytes, str],
        *,
        daemon_uid: int | None = None,
        groups: GroupsOf = groups_of,
    ) -> None:
        """``transports``: socket name -> ``"ipc"`` or ``"tcp"``; ``curve_clients``:
        allow-listed CURVE public keys (32 raw bytes) -> name."""
        self._security = security
        self._transports = dict(transports)
        self._curve_clients = dict(curve_clients)
        self._trusted_uids = frozenset({0, os.geteuid() if daemon_uid is None else daemon_uid})
        self._groups = groups

    def decide(
        self, socket: str, address: str, mechanism: bytes, credentials: list[bytes]
    ) -> Decision:
        transport = self._transports.get(socket)
        if transport is None:
            return Decision(None, f"unknown ZAP domain {socket!r}")
        if mechanism == b"CURVE":
            return self._curve(socket, address, credentials)
        if mechanism != b"NULL":
            return Decision(None, f"mechanism {mechanism.decode(errors='replace')} is not used")
        if transport == "ipc":
            return self._ipc(socket, address)
        if self._security.access(socket).allow:
            return Decision(None, "a tcp peer without CURVE has no identity an allow-list admits")
        return Decision(Peer("tcp", address=address))

    def _ipc(self, socket: str, address: str) -> Decision:
        parts = address.rsplit(":", 3)
        if len(parts) != 4 or not all(part.isdigit() for part in parts[1:]):
            return Decision(None, f"no peer credentials in the ZAP address {address!r}")
        uid, gid, pid = (int(part) for part in parts[1:])
        return self.local(socket, uid, gid, pid)

    def local(self, socket: str, uid: int, gid: int, pid: int) -> Decision:
        """The decision for a local peer whose credentials the kernel gave
        (``SO_PEERCRED``): an ``ipc://`` socket's, or ``shm.sock``'s under the infer
        socket's allow-list."""
        groups = self._groups(uid, gid)
        allow = self._security.access(socket).allow
        if allow and uid not in self._trusted_uids and not _matches(allow, uid, groups, None):
            return Decision(None, f"uid {uid} is not in security.{socket}_allow")
        operator = uid in self._trusted_uids or _matches(
            self._security.operators, uid, groups, None
        )
        return Decision(
            Peer("ipc", uid=uid, gid=gid, pid=pid, user=user_name(uid), operator=operator)
        )

    def names_locally(self, socket: str, uid: int, gid: int) -> bool:
        """Whether a local peer is root, the daemon's user, or a user or group
        ``socket``'s allow-list names (not merely admitted by an empty list)."""
        if uid in self._trusted_uids:
            return True
        allow = self._security.access(socket).allow
        return _matches(allow, uid, self._groups(uid, gid), None)

    def _curve(self, socket: str, address: str, credentials: list[bytes]) -> Decision:
        if len(credentials) != 1 or len(credentials[0]) != 32:
            return Decision(None, "malformed CURVE credentials")
        name = self._curve_clients.get(credentials[0])
        if name is None:
            return Decision(None, "the CURVE client key is not in security.curve_clients_dir")
        allow = self._security.access(socket).allow
        if allow and not _matches(allow, None, frozenset(), name):
            return Decision(None, f"CURVE key {name!r} is not in security.{socket}_allow")
        operator = _matches(self._security.operators, None, frozenset(), name)
        return Decision(Peer("tcp", curve_key=name, address=address, operator=operator))


def _matches(
    principals: tuple[Principal, ...], uid: int | None, groups: frozenset[int], key: str | None
) -> bool:
    for principal in principals:
        if principal.kind == "user" and principal.ident == uid:
            return True
        if principal.kind == "group" and principal.ident in groups:
            return True
        if principal.kind == "key" and principal.ident == key:
            return True
    return False
