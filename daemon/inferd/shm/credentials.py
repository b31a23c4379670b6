"""Who is at the other end of a ``shm.sock`` connection: the kernel's credentials of
the peer when it connected (``SO_PEERCRED``), read once at accept."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

#: struct ucred: pid_t pid; uid_t uid; gid_t gid (unsigned: a uid may be past 2**31,
#: and libzmq, hence the infer socket, reads it so).
_UCRED = struct.Struct("iII")


@dataclass(frozen=True)
class PeerCredentials:
    """``struct ucred`` of the peer when it connected (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, sock: socket.socket) -> PeerCredentials:
        """The kernel's credentials of the peer connected to the Unix socket ``sock``."""
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        pid, uid, gid = _UCRED.unpack(raw)
        return cls(pid, uid, gid)
