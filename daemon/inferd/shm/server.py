"""The ``shm.sock`` listener: clients connect here to hand the daemon sealed
memfds and to send infer requests on them (DESIGN.md 104).

A ``SOCK_SEQPACKET`` Unix socket (``shm.socket``, next to the infer socket by
default) in a directory ``ensure_owned_dir`` accepts, mode ``0660`` like the
ipc sockets.  This thread (``inferd-shm``) accepts connections: bounded per
peer uid (``shm.max_connections_per_uid``) and in all (``shm.max_connections``;
one more is answered ``RESOURCE_EXHAUSTED`` and closed), each peer's
pid/uid/gid read once (``SO_PEERCRED``) and checked against
``security.infer_allow`` as the infer socket checks it (refused:
``PERMISSION_DENIED``, closed).  An accepted connection goes to
``ShmConnections``, where the threads serving requests read it.  The thread
also unmaps the regions whose last lease was given back or whose connection
went (``RegionTable.release_due``), so no other thread ever unmaps, and at
``stop`` closes every connection and releases every region.

Under the kernel's strict overcommit a client could end the daemon with a
SIGBUS through any region (``memfd``): ``start`` then binds nothing and starts
no thread, logs ``shm_refused_strict_overcommit`` (ERROR), and ``status`` says
shm is off and why; the daemon serves on without it.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

import structlog

from inferd.config import ShmConfig
from inferd.owned_files import ensure_owned_dir
from inferd.shm.closer import DescriptorCloser
from inferd.shm.connections import ShmConnections, hand_over
from inferd.shm.memfd import OVERCOMMIT_MEMORY, strict_overcommit
from inferd.shm.regions import OTHER_UIDS as OTHER_UIDS
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd_wire import protocol
from inferd_wire.protocol import Code
from inferd_wire.regions import shmem_huge_pages

log = structlog.get_logger("inferd.shm")

#: The selector's timeout: how often, at the least, the thread looks for work.
_POLL_S = 0.5
#: How long shutdown waits for the descriptors still to be closed.
_CLOSER_STOP_S = 2.0
#: How long a registration at a bound waits for this thread to unmap the released
#: regions no request holds: woken at once, it takes microseconds; longer only while
#: a release hook holds it up, and then the registration is refused after this
#: (the thread that reads the connection, the bus thread, waits that long at most).
UNMAP_WAIT_S = 0.05
#: How long the listener is left alone after ``accept`` failed (``EMFILE``,
#: ``ENFILE``, ``ENOMEM``): the connection stays queued and the listener readable,
#: so trying again at once spins the thread.
_ACCEPT_PAUSE_S = _POLL_S

#: The uids whose refusals at accept are counted each on its own, those over
#: ``max_connections_per_uid`` (``status.shm.refused_by_uid``) and those
#: ``security.infer_allow`` refuses (``denied_by_uid``), each with its own first
#: uids (the metric's ``uid`` label); those of any later uid are counted under
#: ``OTHER_UIDS``, so that the label's values stay bounded however many users
#: connect over a run.
MAX_REFUSED_UIDS = 16

#: Why a peer (uid, gid, pid) may not use the socket (None: it may).
AdmitPeer = Callable[[int, int, int], str | None]


class ShmServer(threading.Thread):
    """The ``shm.sock`` listener's thread, the daemon's ``RegionTable`` and its
    ``ShmConnections``."""

    def __init__(
        self,
        config: ShmConfig,
        admit: AdmitPeer = lambda _uid, _gid, _pid: None,
        overcommit_memory: Path = OVERCOMMIT_MEMORY,
    ) -> None:
        super().__init__(name="inferd-shm", daemon=True)
        self._config = config
        self._admit = admit
        self._overcommit_memory = overcommit_memory
        #: Why ``start`` served nothing (strict overcommit), or None.
        self.refused: str | None = None
        self.table = RegionTable(config, wake=self.wake, unmap_wait_s=UNMAP_WAIT_S)
        self.closer = DescriptorCloser()
        self.connections = ShmConnections(
            self.table, config.max_requests_per_connection, self.closer
        )
        self._selector = selectors.DefaultSelector()
        self._waker, self._wakee = socket.socketpair()
        self._waker.setblocking(False)
        self._wakee.setblocking(False)
        self._listener: socket.socket | None = None
        self._ids = count(1)
        self._stopping = threading.Event()
        #: ``time.monotonic()`` before which no connection is accepted (a failed accept).
        self._accept_paused_until = 0.0
        #: Connections refused because their uid held ``max_connections_per_uid``: in
        #: all, and by uid; and those ``security.infer_allow`` refused, by uid
        #: (written by this thread only).
        self.refused_per_uid = 0
        self._refused_by_uid: dict[str, int] = {}
        self._denied_by_uid: dict[str, int] = {}

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
            # Its group (``security.infer_group``) and then mode 0660 are given with
            # the ipc sockets' (``open_ipc_sockets_to_group``): until then the umask's
            # mode admits no one but the daemon's user.
            listener.bind(str(path))
            listener.listen(self._config.max_connections)
        except BaseException:
            listener.close()
            raise
        self._listener = listener

    def start(self) -> None:
        self.refused = self._overcommit_refusal()
        if self.refused is not None:
            log.error("shm_refused_strict_overcommit", reason=self.refused)
            return  # ``stop`` releases what ``__init__`` made (``ident`` is None)
        self.bind()
        self.closer.start()
        super().start()

    def _overcommit_refusal(self) -> str | None:
        try:
            return strict_overcommit(self._overcommit_memory)
        except (OSError, ValueError) as exc:  # no /proc/sys in a sandbox: served unchecked
            log.warning("shm_overcommit_unknown", path=str(self._overcommit_memory), error=str(exc))
            return None

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection, release every region, remove the socket: the
        thread does as it ends, or this call when it never started (``start``
        failed: the bind, or a thread at the process's limit, DESIGN.md 166)."""
        self._stopping.set()
        self.wake()
        if self.ident is None:
            self._release()
        elif self.is_alive():
            self.join(timeout)

    def wake(self) -> None:
        """Make the thread look at the table now (a lease was given back); any thread."""
        with contextlib.suppress(BlockingIOError, OSError):
            self._waker.send(b"\0")

    def status(self) -> dict[str, Any]:
        if self.refused is not None:
            return {"enabled": False, "reason": self.refused}
        config = self._config
        return {
            "enabled": True,
            "socket": str(config.socket),
            "thread_alive": self.is_alive(),
            "max_connections": config.max_connections,
            "max_connections_per_uid": config.max_connections_per_uid,
            "refused_per_uid": self.refused_per_uid,
            "refused_by_uid": dict(self._refused_by_uid),
            "denied_by_uid": dict(self._denied_by_uid),
            "max_regions_per_connection": config.max_regions_per_connection,
            "max_bytes_per_uid": config.max_bytes_per_uid,
            "max_bytes_total": config.max_bytes_total,
            "huge_pages": shmem_huge_pages(),
            **self.connections.status(),
            **self.table.status(),
        }

    # -- the thread -----------------------------------------------------------------
    def run(self) -> None:
        listener = self._listener
        assert listener is not None, "start() binds first"
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wakee, selectors.EVENT_READ)
        accepting = True
        try:
            while not self._stopping.is_set():
                # None accepted, even to refuse, while the closer is saturated or
                # after an accept failed.
                paused = time.monotonic() < self._accept_paused_until
                if accepting == (self.closer.saturated or paused):
                    accepting = not accepting
                    if accepting:
                        self._selector.register(listener, selectors.EVENT_READ)
                    else:
                        self._selector.unregister(listener)
                for key, _ in self._selector.select(_POLL_S):
                    try:
                        if key.fileobj is listener:
                            self._accept(listener)
                        else:
                            with contextlib.suppress(BlockingIOError):
                                while self._wakee.recv(4096):
                                    pass
                    except Exception:  # a bug must not end registration for everyone
                        log.exception("shm_handler_failed")
                self.table.release_due()
        finally:
            self._release()

    def _release(self) -> None:
        """Release it all: as the thread ends, or in ``stop`` when it never started
        (a second ``stop`` runs this again: every close here may run twice)."""
        self.connections.close_all()
        self.table.close_all()
        self.closer.stop(_CLOSER_STOP_S)  # never started: nothing to join
        self._selector.close()
        if self._listener is not None:  # bound: the socket file is ours
            self._listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self._config.socket)
        self._waker.close()
        self._wakee.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors or memory: not again at once
            self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S
            log.warning("shm_accept_failed", error=exc.strerror, retry_s=_ACCEPT_PAUSE_S)
            return
        sock.setblocking(False)
        peer = PeerCredentials.of(sock)
        refusal = self._admit(peer.uid, peer.gid, peer.pid)
        if refusal is not None:
            _count_by_uid(self._denied_by_uid, peer.uid)
            self._refuse(sock, peer, Code.PERMISSION_DENIED, refusal)
        elif self.closer.backed_up:
            self._refuse(
                sock,
                peer,
                Code.RESOURCE_EXHAUSTED,
                "descriptors clients passed wait to be closed behind one whose close does not "
                "end (status.shm.closing); try again later",
            )
        elif self.connections.held_by(peer.uid) >= self._config.max_connections_per_uid:
            # Before the daemon-wide bound: the uid that fills it is told it is its own.
            _count_by_uid(self._refused_by_uid, peer.uid)
            self.refused_per_uid += 1
            self._refuse(
                sock,
                peer,
                Code.RESOURCE_EXHAUSTED,
                f"uid {peer.uid} holds {self._config.max_connections_per_uid} shm connections "
                "already (shm.max_connections_per_uid); close one first",
            )
        elif len(self.connections) >= self._config.max_connections:
            self._refuse(
                sock,
                peer,
                Code.RESOURCE_EXHAUSTED,
                f"the daemon holds {self._config.max_connections} shm connections already "
                "(shm.max_connections)",
            )
        else:
            self.connections.add(sock, Connection(next(self._ids), peer))

    def _refuse(self, sock: socket.socket, peer: PeerCredentials, code: Code, reason: str) -> None:
        """Answer a connection refused at accept (id null), then close it."""
        self.table.count_refusal(code)
        log.warning(
            "shm_connection_refused", pid=peer.pid, uid=peer.uid, code=str(code), reason=reason
        )
        with contextlib.suppress(OSError):
            sock.send(protocol.pack(protocol.error_header(None, code, reason)))
        hand_over(sock, self.closer)


def _count_by_uid(counts: dict[str, int], uid: int) -> None:
    """Count a refusal of ``uid`` in ``counts``: under its own uid if it has a count
    already or fewer than ``MAX_REFUSED_UIDS`` uids have, else under ``OTHER_UIDS``."""
    key = str(uid)
    if key not in counts and len(counts) >= MAX_REFUSED_UIDS:
        key = OTHER_UIDS
    counts[key] = counts.get(key, 0) + 1
