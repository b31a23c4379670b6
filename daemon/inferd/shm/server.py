"""The registration socket: clients hand the daemon sealed memfds here.

A ``SOCK_SEQPACKET`` Unix socket (``shm.socket``, next to the infer socket by
default) in a directory ``ensure_owned_dir`` accepts, mode ``0660`` like the
ipc sockets, served by one thread of its own (``inferd-shm``) with a selector:
every socket is non-blocking, connections are bounded
(``shm.max_connections``; one more is answered ``RESOURCE_EXHAUSTED`` and
closed), messages are bounded (``MAX_SHM_MESSAGE_BYTES``; larger ones are
truncated by the kernel and refused) and so are the descriptors each carries
(one; more, or a truncated control message, is refused; every received
descriptor is closed once handled: a mapping needs none).  Each message is a
msgpack header (``register`` with the memfd as ``SCM_RIGHTS`` ancillary data,
or ``unregister``) answered with the bus's reply headers.  The peer's
pid/uid/gid (``SO_PEERCRED``) is read once, at accept.  A connection that goes
away, or does not read its replies, is closed and its regions released
(``RegionTable.disconnect``); that is how a killed client's regions go.  The
thread also unmaps the regions whose last lease was given back
(``RegionTable.release_due``), so no other thread ever unmaps.
"""

from __future__ import annotations

import array
import contextlib
import os
import selectors
import socket
import stat
import struct
import threading
from itertools import count
from typing import Any

import structlog

from inferd.config import ShmConfig
from inferd.owned_files import ensure_owned_dir
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError, RequestId
from inferd_wire.regions import (
    MAX_SHM_MESSAGE_BYTES,
    SHM_OPS,
    parse_label,
    parse_region_id,
    shown,
)

log = structlog.get_logger("inferd.shm")

#: Mode of the socket file: the daemon's group may connect (as to ``infer.sock``).
SOCKET_MODE = 0o660
#: The selector's timeout: how often, at the least, the thread looks for work.
_POLL_S = 0.5
_UCRED = struct.Struct("3i")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
_FD = array.array("i").itemsize


class ShmServer(threading.Thread):
    """The registration socket's thread and the daemon's ``RegionTable``."""

    def __init__(self, config: ShmConfig) -> None:
        super().__init__(name="inferd-shm", daemon=True)
        self._config = config
        self.table = RegionTable(config, wake=self.wake)
        self._selector = selectors.DefaultSelector()
        self._waker, self._wakee = socket.socketpair()
        self._waker.setblocking(False)
        self._wakee.setblocking(False)
        self._listener: socket.socket | None = None
        self._connections: dict[int, tuple[socket.socket, Connection]] = {}
        self._ids = count(1)
        self._stopping = threading.Event()

    # -- lifecycle (main thread) ----------------------------------------------------
    def bind(self) -> None:
        """Create the socket (on the caller's thread, so a failure stops start-up)."""
        path = self._config.socket
        ensure_owned_dir(path.parent, what="the directory of shm.socket")
        with contextlib.suppress(FileNotFoundError):
            # A socket left by a daemon that died: the instance lock is ours, so it is
            # stale (ZeroMQ replaces its ipc sockets the same way).  Nothing else is
            # ever removed.
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        listener = socket.socket(
            socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        )
        try:
            listener.bind(str(path))
            os.chmod(path, SOCKET_MODE)
            listener.listen(self._config.max_connections)
        except BaseException:
            listener.close()
            raise
        self._listener = listener

    def start(self) -> None:
        self.bind()
        super().start()

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection, release every region, remove the socket."""
        self._stopping.set()
        self.wake()
        if self.is_alive():
            self.join(timeout)

    def wake(self) -> None:
        """Make the thread look at the table now (a lease was given back); any thread."""
        with contextlib.suppress(BlockingIOError, OSError):
            self._waker.send(b"\0")

    def status(self) -> dict[str, Any]:
        config = self._config
        return {
            "enabled": True,
            "socket": str(config.socket),
            "thread_alive": self.is_alive(),
            "connections": len(self._connections),
            "max_connections": config.max_connections,
            "max_regions_per_connection": config.max_regions_per_connection,
            "max_bytes_per_uid": config.max_bytes_per_uid,
            "max_bytes_total": config.max_bytes_total,
            **self.table.status(),
        }

    # -- the thread -----------------------------------------------------------------
    def run(self) -> None:
        listener = self._listener
        assert listener is not None, "start() binds first"
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wakee, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                for key, _ in self._selector.select(_POLL_S):
                    try:
                        self._ready(key.fileobj)  # type: ignore[arg-type]
                    except Exception:  # a bug must not end registration for everyone
                        log.exception("shm_handler_failed")
                        if key.fileobj not in (listener, self._wakee):
                            self._close(key.fileobj)  # type: ignore[arg-type]
                self.table.release_due()
        finally:
            for sock, _ in list(self._connections.values()):
                self._close(sock)
            self.table.close_all()
            self._selector.close()
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self._config.socket)
            self._waker.close()
            self._wakee.close()

    def _ready(self, sock: socket.socket) -> None:
        if sock is self._listener:
            self._accept(sock)
        elif sock is self._wakee:
            with contextlib.suppress(BlockingIOError):
                while sock.recv(4096):
                    pass
        else:
            self._receive(sock)

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        pid, uid, gid = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if len(self._connections) >= self._config.max_connections:
            self.table.count_refusal(Code.RESOURCE_EXHAUSTED)
            log.warning("shm_connection_refused", pid=pid, uid=uid, limit=len(self._connections))
            with contextlib.suppress(OSError):
                sock.send(
                    protocol.pack(
                        protocol.error_header(
                            None,
                            Code.RESOURCE_EXHAUSTED,
                            f"the daemon holds {self._config.max_connections} registration "
                            "connections already (shm.max_connections)",
                        )
                    )
                )
            sock.close()
            return
        connection = Connection(next(self._ids), PeerCredentials(pid, uid, gid))
        self._connections[sock.fileno()] = (sock, connection)
        self._selector.register(sock, selectors.EVENT_READ)

    def _receive(self, sock: socket.socket) -> None:
        try:
            data, ancillary, flags, _ = sock.recvmsg(
                MAX_SHM_MESSAGE_BYTES + 1, socket.CMSG_SPACE(2 * _FD), socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(sock)
            return
        fds = _descriptors(ancillary)
        try:
            if not data and not fds:  # the peer closed the connection
                self._close(sock)
                return
            _, connection = self._connections[sock.fileno()]
            reply = self._answer(connection, data, fds, flags)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            sock.send(protocol.pack(reply))
        except BlockingIOError:
            log.warning("shm_peer_not_reading", pid=connection.peer.pid)
            self._close(sock)
        except OSError:
            self._close(sock)

    def _answer(
        self, connection: Connection, data: bytes, fds: list[int], flags: int
    ) -> dict[str, Any]:
        request_id: RequestId | None = None
        try:
            if flags & socket.MSG_TRUNC:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT,
                    f"message is over {MAX_SHM_MESSAGE_BYTES} bytes",
                )
            header = protocol.unpack_header(data, MAX_SHM_MESSAGE_BYTES, check_version=False)
            request_id = protocol.request_id_of(header)
            protocol.require_version(header)
            protocol.require_request_id(header)
            if flags & socket.MSG_CTRUNC or len(fds) > 1:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT, "a message carries at most one descriptor"
                )
            result = self._operation(connection, header, fds)
        except ProtocolError as exc:
            self.table.count_refusal(exc.code)
            log.info("shm_request_refused", code=str(exc.code), reason=exc.message)
            return protocol.error_header(request_id, exc.code, exc.message)
        return protocol.ok_header(request_id, result=result)

    def _operation(
        self, connection: Connection, header: dict[str, Any], fds: list[int]
    ) -> dict[str, Any]:
        op = header.get("op")
        if op == "register":
            label = parse_label(header.get("label"))
            if len(fds) != 1:
                raise ProtocolError(
                    Code.INVALID_ARGUMENT,
                    "'register' carries the memfd as SCM_RIGHTS ancillary data; none came",
                )
            region = self.table.register(connection, fds[0], label)
            return {"region": region.region_id, "nbytes": region.size}
        if op == "unregister":
            if fds:
                raise ProtocolError(Code.INVALID_ARGUMENT, "'unregister' carries no descriptor")
            region_id = parse_region_id(header.get("region"))
            self.table.unregister(connection, region_id)
            log.info("shm_region_unregistered", region=shown(region_id))
            return {"region": region_id}
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"unknown op {op!r} on the shm socket; it serves {list(SHM_OPS)}"
        )

    def _close(self, sock: socket.socket) -> None:
        entry = self._connections.pop(sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()
        if entry is not None:
            self.table.disconnect(entry[1])


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % _FD])
    return list(fds)
