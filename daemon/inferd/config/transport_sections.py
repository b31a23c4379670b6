"""The sections of the daemon's sockets: ``[bus]`` (the ZeroMQ sockets) and
``[shm]`` (``shm.sock`` and the shared-memory regions), frozen dataclasses that
check themselves (``every_rule``: each refusal naming its key).  Re-exported by
``inferd.config.sections``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inferd.config.ceilings import (
    MAX_BUSY_POLL_US,
    MAX_CONNECTIONS_PER_SOCKET,
    MAX_FRAMES,
    MAX_HEADER_FRAME_BYTES,
    MAX_HEARTBEAT_MS,
    MAX_MEMORY_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_REGIONS_PER_CONNECTION,
    MAX_REQUESTS_IN_FLIGHT,
)
from inferd.config.checks import endpoint, one_to, positive, socket_file, up_to
from inferd.config.refusals import every_rule, refuse
from inferd_wire.endpoints import DEFAULT_SEND_BUFFER_BYTES, MAX_SEND_BUFFER_BYTES


@dataclass(frozen=True)
class BusConfig:
    infer_endpoint: str
    control_endpoint: str
    events_endpoint: str
    max_message_bytes: int = 256 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_frames: int = 64
    #: Reply bytes handed to ZeroMQ and not yet written to a peer's connection:
    #: per peer (a reply to a peer over it is dropped, counted) and in total.
    max_reply_bytes_per_peer: int = 32 * 1024 * 1024
    max_reply_bytes_total: int = 256 * 1024 * 1024
    #: ZMTP heartbeats on the ROUTER sockets (0: off): a peer silent this long
    #: after a PING is disconnected and its queue freed.
    heartbeat_interval_ms: int = 1000
    heartbeat_timeout_ms: int = 5000
    #: After each reply the engine worker polls the request sources this long
    #: without sleeping before it waits on them (0: never; DESIGN.md 110).
    busy_poll_us: int = 50
    #: ``SO_SNDBUF`` of each ``ipc://`` connection (``ZMQ_SNDBUF`` on ``tcp://``)
    #: of the infer socket, so a reply's tensor leaves in one write (0: the
    #: kernel's default; DESIGN.md 116).  Each connection may hold this much of a
    #: reply in the kernel, beyond the reply budget.
    send_buffer_bytes: int = DEFAULT_SEND_BUFFER_BYTES
    #: Connections one peer may hold on each ZeroMQ socket; ZAP refuses more (DESIGN 128).
    max_connections: int = 256

    @every_rule
    def __post_init__(self) -> None:
        names = ("infer_endpoint", "control_endpoint", "events_endpoint")
        for name in names:
            endpoint(f"bus.{name}", getattr(self, name))
        if len({socket_file(getattr(self, name)) for name in names}) != 3:
            keys = [f"bus.{name}" for name in names]
            refuse("bus: infer, control and events endpoints must all differ", *keys)
        one_to("bus.max_message_bytes", self.max_message_bytes, MAX_MESSAGE_BYTES)
        one_to("bus.max_header_bytes", self.max_header_bytes, MAX_HEADER_FRAME_BYTES)
        one_to("bus.max_frames", self.max_frames, MAX_FRAMES)
        positive("bus.max_reply_bytes_per_peer", self.max_reply_bytes_per_peer)
        one_to("bus.max_reply_bytes_total", self.max_reply_bytes_total, MAX_MEMORY_BYTES)
        if self.max_reply_bytes_total < self.max_reply_bytes_per_peer:
            refuse(
                f"bus.max_reply_bytes_total ({self.max_reply_bytes_total}) must be at least "
                f"bus.max_reply_bytes_per_peer ({self.max_reply_bytes_per_peer})",
                "bus.max_reply_bytes_total",
                "bus.max_reply_bytes_per_peer",
            )
        for key in ("heartbeat_interval_ms", "heartbeat_timeout_ms"):
            up_to(f"bus.{key}", getattr(self, key), MAX_HEARTBEAT_MS, " ms")
        up_to("bus.busy_poll_us", self.busy_poll_us, MAX_BUSY_POLL_US)
        up_to("bus.send_buffer_bytes", self.send_buffer_bytes, MAX_SEND_BUFFER_BYTES)
        one_to("bus.max_connections", self.max_connections, MAX_CONNECTIONS_PER_SOCKET)
        if self.heartbeat_interval_ms and self.heartbeat_timeout_ms < self.heartbeat_interval_ms:
            refuse(
                f"bus.heartbeat_timeout_ms ({self.heartbeat_timeout_ms}) must be at least "
                f"bus.heartbeat_interval_ms ({self.heartbeat_interval_ms})",
                "bus.heartbeat_timeout_ms",
                "bus.heartbeat_interval_ms",
            )


@dataclass(frozen=True)
class ShmConfig:
    """Shared-memory tensor regions (``[shm]``): every byte, mapping and descriptor a
    client can make the daemon hold through the registration socket is bounded here."""

    #: The registration socket; clients find it next to the infer socket.
    socket: Path
    enabled: bool = True
    max_connections: int = 16
    #: Connections one uid (SO_PEERCRED) may hold at once, so that one user's idle
    #: connections cannot take every slot: half the default ``max_connections``
    #: leaves the other half to the vehicle's other users whatever one does, and
    #: is twice what a uid of a few client processes needs (one connection per
    #: client object that uses a region).
    max_connections_per_uid: int = 8
    max_regions_per_connection: int = 16
    #: Infer requests one connection may have read and not yet answered.
    max_requests_per_connection: int = 64
    #: Mapped bytes of every region one uid (SO_PEERCRED) registered, and of all.
    max_bytes_per_uid: int = 512 * 1024**2
    max_bytes_total: int = 1024**3

    @every_rule
    def __post_init__(self) -> None:
        endpoint("shm.socket", f"ipc://{self.socket}")
        for key in ("max_connections", "max_connections_per_uid"):
            one_to(f"shm.{key}", getattr(self, key), MAX_CONNECTIONS_PER_SOCKET)
        regions = self.max_regions_per_connection
        one_to("shm.max_regions_per_connection", regions, MAX_REGIONS_PER_CONNECTION)
        requests = self.max_requests_per_connection
        one_to("shm.max_requests_per_connection", requests, MAX_REQUESTS_IN_FLIGHT)
        positive("shm.max_bytes_per_uid", self.max_bytes_per_uid)
        one_to("shm.max_bytes_total", self.max_bytes_total, MAX_MEMORY_BYTES)
        if self.max_bytes_total < self.max_bytes_per_uid:
            refuse(
                f"shm.max_bytes_total ({self.max_bytes_total}) must be at least "
                f"shm.max_bytes_per_uid ({self.max_bytes_per_uid})",
                "shm.max_bytes_total",
                "shm.max_bytes_per_uid",
            )
