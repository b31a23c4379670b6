"""What goes through the recorder's queue to its writer thread (records encoded
but for their seq, and the markers ``wait_durable`` waits on), and the queue
itself, bounded in items and in the bytes of the records it holds."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from inferd.fdr import framing, kinds

#: Why a record was not queued (the ``fdr_dropped`` reasons of a full queue).
QUEUE_FULL = "queue full"
QUEUE_BYTES_FULL = "queue bytes full"
#: Why a record found no room in the queue.
QUEUE_OVERFLOWS = (QUEUE_FULL, QUEUE_BYTES_FULL)
#: Why a record offered once the writer stopped (or as it stops) was not queued.
RECORDER_STOPPED = "recorder stopped"


class RecordDroppedError(ConnectionError):
    """``record_alert``: the record was dropped, not queued (counted in ``records_dropped``)."""


_FRAME_OVERHEAD = framing.FRAME_HEADER.size + framing.MAX_SEQ_BYTES


@dataclass
class Pending:
    """A record encoded but for its seq (assigned when it is written)."""

    kind: kinds.RecordKind
    head: bytes
    tail: bytes
    #: What an fdr_dropped / fdr_retention record reports (again, if it is lost).
    dropped: tuple[int, list[str]] | None = None
    deleted: list[tuple[str, int]] | None = None
    #: The most its frame takes, whatever its seq: what it counts for queued.
    frame_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.frame_bytes = _FRAME_OVERHEAD + len(self.head) + len(self.tail)


def encoded(
    kind: kinds.RecordKind,
    payload: Any,
    wall_ns: int,
    mono_ns: int,
    boot_id: str,
    segment_max_bytes: int,
) -> Pending:
    """A record encoded once, in the caller (``FlightRecorder.record``): the writer
    thread only adds the seq and the frame.  RecordPayloadError if it cannot be."""
    try:
        head, tail = framing.encode_record_parts(
            kind.name,
            kind.schema_version,
            wall_ns,
            mono_ns,
            boot_id,
            payload,
            segment_max_bytes=segment_max_bytes,
        )
    except ValueError as exc:
        raise kinds.RecordPayloadError(f"{kind.name}: {exc}") from exc
    return Pending(kind, head, tail)


class Marker(threading.Event):
    """Queued by ``wait_durable``; set once everything before it was processed."""

    durable = False


class RecordQueue:
    """The queue between the daemon's threads and the writer: at most ``capacity``
    items, and records whose frames add up to at most ``max_bytes`` from their
    ``offer`` until the writer ``release``s them (written or dropped), so a batch
    in the writer's hands counts too.  A record's size is the length of the bytes
    it was encoded into, taken once when it is made."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self._items: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        #: Bytes of the records offered and not yet released.
        self.bytes = 0
        #: Set by the writer once it stopped (``close``): no record is queued after it.
        self._closed = False

    def offer(self, pending: Pending) -> str | None:
        """Queue ``pending`` without blocking: None, or why it was not (nothing held).
        Under the lock ``close`` takes: a record is queued before it or refused."""
        size = pending.frame_bytes
        with self._lock:
            if self._closed:
                return RECORDER_STOPPED
            if self.bytes + size > self._max_bytes:
                return QUEUE_BYTES_FULL
            try:
                self._items.put_nowait(pending)
            except queue.Full:
                return QUEUE_FULL
            self.bytes += size
        return None

    def close(self) -> None:
        """The writer stopped: every later ``offer`` is refused (``RECORDER_STOPPED``),
        so none waits in a queue no one reads, uncounted (review R4, F6)."""
        with self._lock:
            self._closed = True

    def put(self, item: Any, timeout: float) -> None:
        """Queue a marker (not a record); raises ``queue.Full`` after ``timeout`` s."""
        self._items.put(item, timeout=timeout)

    def take_batch(self, timeout: float | None, most: int) -> list[Any]:
        """Up to ``most`` items, waiting up to ``timeout`` s for the first ([] if none)."""
        try:
            batch = [self._items.get(timeout=timeout)]
        except queue.Empty:
            return []
        while len(batch) < most:
            try:
                batch.append(self._items.get_nowait())
            except queue.Empty:
                break
        return batch

    def release(self, batch: list[Any]) -> None:
        """The records of ``batch`` are written or dropped: their bytes no longer count."""
        size = sum(item.frame_bytes for item in batch if isinstance(item, Pending))
        with self._lock:
            self.bytes -= size

    def qsize(self) -> int:
        return self._items.qsize()
