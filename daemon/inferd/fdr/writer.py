"""The recorder's writer: a thread with a bounded queue and group commit.

``record()`` validates and encodes in the caller (a bad payload is a bug and raises
there) and enqueues without ever blocking: a full queue (in records,
``queue_capacity``, or in bytes, ``queue_max_bytes``: ``queued.RecordQueue``) or a
failing disk drops records, counts them, logs at ERROR and says so in ``status()``,
an ``fdr_dropped`` record and, once per outage, an alert (``outage.py``); serving
goes on.  The writer thread appends frames to the current segment and makes them
durable (``fdatasync``) at most every ``fsync_interval_ms``, or at once when a
critical kind was written.  After a failed write or sync it never appends to that
segment again: it syncs what earlier writes, and the frames a failed write wrote
whole, left there, counts what was written but could not be synced as dropped, and
opens a new one.  One recorder a directory (``segments.lock_directory``)."""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from inferd.config import FdrConfig
from inferd.fdr import framing, kinds, queued, reports, segments
from inferd.fdr.inventory import Inventory
from inferd.fdr.outage import Outage, Overflow
from inferd.fdr.queued import Marker, Pending, RecordQueue, encoded
from inferd.owned_files import ensure_owned_dir
from inferd.process_identity import read_boot_id
from inferd.types import AlertSink

log = structlog.get_logger("inferd.fdr")

_STOP = object()
_RETRY_AFTER_FAILURE_NS = 1_000_000_000
_BACKING_OFF = "recorder is backing off after a failure"
_BATCH = 256


class _BackingOff(OSError):
    """No segment for a second after a failure: records dropped, counted; no disk touched."""


class FlightRecorder:
    def __init__(
        self,
        config: FdrConfig,
        *,
        wall_clock: Callable[[], int] = time.time_ns,
        mono_clock: Callable[[], int] = time.monotonic_ns,
        boot_id: str | None = None,
    ) -> None:
        self._config = config
        self._directory = config.directory
        self._wall_clock = wall_clock
        self._mono_clock = mono_clock
        self._boot_id = boot_id if boot_id is not None else read_boot_id()
        self._interval_s = config.fsync_interval_ms / 1000
        self._queue = RecordQueue(config.queue_capacity, config.queue_max_bytes)
        self._thread = threading.Thread(target=self._run, name="inferd-fdr", daemon=True)
        self._lock_fd: int | None = None  # the directory's lock, from start to _run's end
        self._disk_full: int | None = None  # ENOSPC, EDQUOT: the next segment makes room
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._segment: segments.Segment | None = None
        self._inventory = Inventory()  # the segments on disk, scanned at start, then kept
        self._next_index = 1
        self._next_seq = 1
        self._last_failure_mono_ns: int | None = None
        self._outage = Outage(self._directory)  # fdr_write_outage, once per outage
        self._overflow = Overflow(self._outage)  # records a full queue refused
        #: Highest seq written to the current segment's file: what an fdatasync makes durable.
        self._written_seq = 0
        # Written to the current segment since its last fdatasync: lost with it
        # if a write or sync fails (DESIGN.md entry 13).
        self._unsynced_records = 0
        self._unsynced_reports: list[Pending] = []
        self._unsynced_critical = False
        #: Drops counted by fdr_dropped records that are durable.
        self._reported_drops = 0
        #: Segments the size cap deleted that no durable fdr_retention names yet.
        self._deleted: list[tuple[str, int]] = []
        # Counters (read by status() from other threads; ints are updated atomically).
        self.records_written = 0
        self.records_dropped = 0
        self.bytes_written = 0
        self.syncs = 0
        self.durable_seq = 0
        self.segments_deleted = 0
        self.last_error: str | None = None
        self._unreported_drops = 0
        self._drop_reasons: set[str] = set()

    # -- lifecycle ---------------------------------------------------------
    def start(self, alert: AlertSink | None = None) -> None:
        """Lock the directory, find what earlier runs left (segments, the seq and index to
        go on from: one scan, here and never again), then write; ``alert`` is told once per
        outage (``fdr_write_outage``).  Could not start: stopped, what it is handed dropped."""
        self._outage.alert = alert
        try:
            ensure_owned_dir(self._directory, what="fdr.directory")
            self._lock_fd = segments.lock_directory(self._directory)  # until _run ends
            self._inventory = Inventory.scan(self._directory)
            resumed = segments.resume_point(self._directory, self._inventory)
            self._next_seq, self._next_index = resumed
            self._thread.start()
        except BaseException:
            self._stopped.set()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """Write and sync what is queued, close, join; at most ``timeout`` s (a hung disk)."""
        self._stopped.set()  # later records are dropped; the writer leaves once drained
        self._queue.close()  # refused from now on, counted: each queued before is written
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout
        with contextlib.suppress(queue.Full):  # busy: it sees _stopped once drained
            self._queue.put(_STOP, timeout)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.error("fdr_writer_did_not_stop", timeout_s=timeout)

    # -- producer side (any thread) -------------------------------------------
    def record(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Queue a record; raises RecordPayloadError for an unknown kind, missing
        keys, a payload msgpack cannot encode, or a record too large to write."""
        self._offer(kind, payload, refuse_backing_off=False)

    def record_alert(self, kind: str, payload: Mapping[str, Any]) -> None:
        """``record`` for the ``fdr`` alert hook, which must not count as sent an alert
        that is lost: RecordDroppedError where the record is dropped here (the recorder
        stopped, its queue full) or would be by the writer, backing off after a failure."""
        dropped = self._offer(kind, payload, refuse_backing_off=True)
        if dropped is not None:
            raise queued.RecordDroppedError(f"the recorder dropped the record: {dropped}")

    def _offer(self, kind: str, payload: Mapping[str, Any], refuse_backing_off: bool) -> str | None:
        """Queue a record; why it was dropped (counted) instead, or None."""
        pending = self._encode(kinds.validate(kind, payload), payload)
        dropped = queued.RECORDER_STOPPED if self._stopped.is_set() else None
        if dropped is None and refuse_backing_off and self._backing_off():
            dropped = f"write failed: {_BACKING_OFF}"
        # a queue full, in records or in bytes, refuses it
        dropped = dropped if dropped is not None else self._queue.offer(pending)
        if dropped is not None:
            self._drop(1, dropped)
            if dropped in queued.QUEUE_OVERFLOWS:  # said at once: the disk may be stuck
                self.last_error = self._overflow.dropped(dropped)
        return dropped

    def wait_durable(self, timeout: float) -> bool:
        """Until all queued before is synced; False if one was lost (unless reported)."""
        marker = Marker()
        try:
            self._queue.put(marker, timeout)
        except queue.Full:
            return False
        return marker.wait(timeout) and marker.durable

    def status(self) -> dict[str, Any]:
        """Counters, and what the inventory keeps on disk (one read of ``kept``: no
        listing, no lock, whatever the number of segments)."""
        segment = self._segment
        kept, kept_bytes, oldest = self._inventory.kept
        return {
            "directory": str(self._directory),
            "records_written": self.records_written,
            "records_dropped": self.records_dropped,
            "bytes_written": self.bytes_written,
            "syncs": self.syncs,
            "durable_seq": self.durable_seq,
            "queue_depth": self._queue.qsize(),
            "queue_bytes": self._queue.bytes,
            "segment": segment.path.name if segment else None,
            "segments_deleted": self.segments_deleted,
            "segments_kept": kept,
            "bytes_kept": kept_bytes,
            "max_total_bytes": self._config.max_total_bytes,
            "oldest_segment": None if oldest is None else framing.segment_name(oldest),
            "last_error": self.last_error,
        }

    def _encode(self, kind: kinds.RecordKind, payload: Mapping[str, Any]) -> Pending:
        clocks, limit = (self._wall_clock(), self._mono_clock()), self._config.segment_max_bytes
        return encoded(kind, payload, *clocks, self._boot_id, limit)

    def _drop(self, count: int, reason: str) -> None:
        if count <= 0:
            return
        with self._lock:
            self.records_dropped += count
            self._unreported_drops += count
            self._drop_reasons.add(reason)
            total = self.records_dropped
        if total == count or total % 1000 < count:
            log.error("fdr_records_dropped", count=count, reason=reason, dropped_total=total)

    # -- writer thread -------------------------------------------------------
    def _run(self) -> None:
        dirty_since: float | None = None
        stopping = False
        while not stopping:
            timeout = None
            if self._stopped.is_set():
                timeout = 0.0  # drain, then leave (stop() may not have queued _STOP)
            elif dirty_since is not None:
                timeout = max(0.0, dirty_since + self._interval_s - time.monotonic())
            batch = self._queue.take_batch(timeout, _BATCH)
            stopping = _STOP in batch or (not batch and self._stopped.is_set())
            try:
                failed, dirty_since = self._process(batch, dirty_since, stopping)
            except Exception as exc:  # a recorder thread must never die
                self._fail(exc, "writer")
                failed, dirty_since = True, None
            self._overflow.batch_done()
            # Durable: written and synced, and any loss before it durably reported.
            durable = not failed and dirty_since is None
            if durable:
                self._outage.durable(self.durable_seq)
            self._queue.release(batch)  # written or dropped: their bytes are free
            self._set_markers(batch, durable and self._reported_drops == self.records_dropped)
        self._close_segment()
        if self._lock_fd is not None:  # taken before the thread started (tests run it bare)
            os.close(self._lock_fd)
        while leftover := self._queue.take_batch(0.0, _BATCH):  # never written
            self._drop(sum(isinstance(i, Pending) for i in leftover), queued.RECORDER_STOPPED)
            self._queue.release(leftover)
            self._set_markers(leftover, False)

    def _process(
        self, batch: list[Any], dirty_since: float | None, stopping: bool
    ) -> tuple[bool, float | None]:
        """Write a batch and sync when due; returns (failed, dirty since)."""
        records = [item for item in batch if isinstance(item, Pending)]
        markers = any(isinstance(item, Marker) for item in batch)
        failed = False
        # A loss is reported (``_write``) by the stop, or when a marker asks, records or not
        if records or (self._unreported_drops and (markers or stopping)):
            if self._write(records, last_try=stopping):
                dirty_since = dirty_since if dirty_since is not None else time.monotonic()
            else:
                failed, dirty_since = True, None  # the abandoned segment cannot be synced
        due = dirty_since is not None and time.monotonic() - dirty_since >= self._interval_s
        if dirty_since is not None and (self._unsynced_critical or due or markers or stopping):
            if self._sync():
                dirty_since = None
            else:
                failed, dirty_since = True, None
        return failed, dirty_since

    @staticmethod
    def _set_markers(batch: list[Any], durable: bool) -> None:
        for marker in batch:
            if isinstance(marker, Marker):
                marker.durable = durable
                marker.set()

    def _write(self, records: list[Pending], last_try: bool = False) -> bool:
        """Append records; on failure drop the rest (counted) and abandon the segment.

        A batch goes to the file in one ``write`` per segment: a write releases
        the GIL, and a writer that wrote frame by frame would wait for it after
        every frame behind a busy Python thread (bench/fdr_throughput.py).  No
        frame goes past ``segment_max_bytes`` (``_encode`` refused any record an
        empty segment cannot hold), so the size cap holds (``_open_segment``).
        ``last_try`` (the stop's): a segment is opened even while backing off.
        """
        work: deque[Pending] = deque(records)
        frames: list[tuple[bytes, Pending, int]] = []  # framed, not yet written
        try:
            if self._unreported_drops:
                work.appendleft(self._drop_report())
            segment = self._segment_for_writing(last_try)
            size = segment.size
            while work:
                pending = work[0]
                seq = self._next_seq
                if seq > framing.MAX_SEQ:  # a seq the reader calls corrupt: none is written
                    self._flush(segment, frames)  # those before it are the reader's
                    raise segments.SeqsSpentError(errno.EOVERFLOW, segments.SEQS_SPENT)
                frame = framing.encode_frame(framing.join_body(pending.head, seq, pending.tail))
                if size + len(frame) > self._config.segment_max_bytes:
                    self._flush(segment, frames)
                    frames = []
                    self._close_segment()
                    segment = self._open_segment()
                    size = segment.size
                    continue
                work.popleft()
                frames.append((frame, pending, seq))
                self._next_seq += 1
                size += len(frame)
                if self._deleted:  # after the record whose frame opened the segment
                    work.appendleft(self._retention_report())
            self._flush(segment, frames)
        except Exception as exc:
            self._next_seq = frames[0][2] if frames else self._next_seq  # none of them on disk
            if not isinstance(exc, _BackingOff):
                self._sync()  # what earlier writes left there is kept if it still syncs
                self._fail(exc, "write")
            lost = [pending for _, pending, _ in frames] + list(work)
            for pending in lost:
                self._give_back(pending)
            count = sum(p.dropped is None and p.deleted is None for p in lost)  # records
            self._drop(count, f"write failed: {reports.describe(exc)}")
            return False
        return True

    def _flush(self, segment: segments.Segment, frames: list[tuple[bytes, Pending, int]]) -> None:
        """Write frames (in seq order) in one go.  If the write fails part way, the
        frames it wrote whole are written (the caller syncs them) and leave ``frames``."""
        start = segment.size
        try:
            segments.append(segment, b"".join(frame for frame, _, _ in frames))
        finally:
            length, whole = segment.size - start, 0
            while whole < len(frames) and len(frames[whole][0]) <= length:
                length -= len(frames[whole][0])
                whole += 1
            self._inventory.set_newest_size(segment.size)  # the newest is the one written
            self._written(frames[:whole], segment.size - start)
            del frames[:whole]

    def _written(self, frames: list[tuple[bytes, Pending, int]], length: int) -> None:
        self.bytes_written += length
        if not frames:
            return
        self.records_written += len(frames)
        self._written_seq = frames[-1][2]
        for _, pending, _ in frames:
            self._unsynced_critical = self._unsynced_critical or pending.kind.critical
            if pending.dropped is not None or pending.deleted is not None:
                self._unsynced_reports.append(pending)
            else:
                self._unsynced_records += 1

    def _drop_report(self) -> Pending:
        with self._lock:
            count, self._unreported_drops = self._unreported_drops, 0
            reasons, self._drop_reasons = sorted(self._drop_reasons), set()
        return reports.drop_report(count, reasons, self._encode)

    def _retention_report(self) -> Pending:
        return reports.retention_report(self._deleted, self._config.max_total_bytes, self._encode)

    def _give_back(self, pending: Pending) -> None:
        """What a lost fdr_dropped or fdr_retention record said is reported again."""
        if pending.dropped is not None:
            count, reasons = pending.dropped
            with self._lock:
                self._unreported_drops += count
                self._drop_reasons.update(reasons)
        if pending.deleted is not None:
            self._deleted[:0] = pending.deleted

    def _sync(self) -> bool:
        segment = self._segment
        if segment is None:
            return False
        try:
            os.fdatasync(segment.fd)
        except OSError as exc:
            # After a failed fsync the page cache state is unknown (LevelDB and
            # PostgreSQL treat it as fatal for the file): never reuse the segment.
            self._fail(exc, "fdatasync")
            return False
        self._synced()
        return True

    def _synced(self) -> None:
        self.syncs += 1
        self.durable_seq = self._written_seq
        self._reported_drops += sum(p.dropped[0] for p in self._unsynced_reports if p.dropped)
        self._unsynced_records, self._unsynced_reports, self._unsynced_critical = 0, [], False

    def _segment_for_writing(self, last_try: bool) -> segments.Segment:
        if self._segment is not None:
            return self._segment
        if self._next_seq > framing.MAX_SEQ:  # said once (SeqsSpentError), dropped since
            raise _BackingOff(errno.EOVERFLOW, segments.SEQS_SPENT)
        if not last_try and self._backing_off():
            raise _BackingOff(errno.EAGAIN, _BACKING_OFF)
        return self._open_segment()

    def _backing_off(self) -> bool:
        """No segment open within a second of a failure, or no seq left: records are dropped."""
        failed_at = self._last_failure_mono_ns
        recent = failed_at is not None and self._mono_clock() - failed_at < _RETRY_AFTER_FAILURE_NS
        return self._segment is None and (recent or self._next_seq > framing.MAX_SEQ)

    def _open_segment(self) -> segments.Segment:
        """Make room (the size cap; a full disk: ``segments.make_room``), then create one."""
        before, disk_full, self._disk_full = len(self._deleted), self._disk_full, None
        try:
            segments.make_room(
                self._directory, self._inventory, self._deleted, self._config, disk_full
            )
        finally:
            self.segments_deleted += len(self._deleted) - before
        self._segment = segments.create_next(
            self._directory, self._next_index, self._wall_clock, self._inventory
        )
        self._next_index = self._segment.index + 1
        return self._segment

    def _close_segment(self) -> None:
        segment, self._segment = self._segment, None
        if segment is None:
            return
        try:
            os.fdatasync(segment.fd)
            self._synced()
        except OSError as exc:
            self._fail(exc, "fdatasync on close")
        finally:
            os.close(segment.fd)

    def _fail(self, exc: Exception, operation: str) -> None:
        """Abandon the current segment: what was written there since its last sync
        may not be on disk, so it is counted as dropped (and reported again)."""
        self.last_error = error = f"{operation}: {reports.describe(exc)}"
        self._last_failure_mono_ns = self._mono_clock()
        full = getattr(exc, "errno", None)
        self._disk_full = full if full in (errno.ENOSPC, errno.EDQUOT) else None
        log.error(
            "fdr_write_failed",
            operation=operation,
            error=str(exc),
            exc_info=not isinstance(exc, OSError),  # not a disk: a bug, with its traceback
        )
        for pending in self._unsynced_reports:
            self._give_back(pending)
        lost = self._unsynced_records
        self._unsynced_records, self._unsynced_reports, self._unsynced_critical = 0, [], False
        self._drop(lost, f"{operation} failed before they were synced: {reports.describe(exc)}")
        segment, self._segment = self._segment, None
        if segment is not None:
            with contextlib.suppress(OSError):
                os.close(segment.fd)
        self._outage.failed(error, self._next_seq)
