"""The recorder's writer: a thread with a bounded queue and group commit.

``record()`` validates in the caller (a bad payload is a bug and raises there)
and enqueues without ever blocking: a full queue or a failing disk drops
records, counts them, logs at ERROR and says so in ``status()``; serving goes
on.  The writer thread appends frames to the current segment and makes them
durable (``fdatasync``) at most every ``fsync_interval_ms``, or at once when a
critical kind is in the batch.  After a failed write or sync it never appends
to that segment again (what reached the disk is unknown): it opens a new one.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from inferd.config import FdrConfig
from inferd.durable import fsync_directory, write_all
from inferd.fdr import framing, kinds
from inferd.fdr.reader import ReadReport, list_segments, read_segment
from inferd.owned_files import ensure_owned_dir, open_nofollow

log = structlog.get_logger("inferd.fdr")

_STOP = object()
_RETRY_AFTER_FAILURE_NS = 1_000_000_000
_BATCH = 256


def read_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


@dataclass
class _Pending:
    kind: kinds.RecordKind
    payload: dict[str, Any]
    wall_ns: int
    mono_ns: int


class _Marker(threading.Event):
    """Queued by ``wait_durable``; set once everything before it was processed."""

    durable = False


class _BackingOff(OSError):
    """No segment is opened for a while after a failure: records are dropped
    (and counted) without touching the disk, the failure that started the
    pause stays in ``last_error`` and the pause is not extended."""


@dataclass
class _Segment:
    index: int
    path: Path
    fd: int
    size: int


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
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_capacity)
        self._thread = threading.Thread(target=self._run, name="inferd-fdr", daemon=True)
        self._lock = threading.Lock()
        self._segment: _Segment | None = None
        self._next_index = 1
        self._seq = itertools.count(1)
        self._last_failure_mono_ns: int | None = None
        #: Highest seq written to the current segment's file (not merely framed):
        #: what a successful fdatasync makes durable.
        self._written_seq = 0
        self._durable = threading.Condition()
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
    def start(self) -> None:
        """Find where earlier runs stopped (seq, segment index), then start writing."""
        ensure_owned_dir(self._directory, what="fdr.directory")
        last_seq, last_index = self._resume_point()
        self._seq = itertools.count(last_seq + 1)
        self._next_index = last_index + 1
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Write and sync everything queued, close the segment, join the thread."""
        if not self._thread.is_alive():
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("fdr_writer_did_not_stop", timeout_s=timeout)

    def _resume_point(self) -> tuple[int, int]:
        """The last seq written and the highest segment index taken.  A segment that
        cannot be read (a symlink, which is never followed) holds no seq to resume
        from, but its index stays taken: the next segment comes after it."""
        segments = list_segments(self._directory)
        last_index = max((framing.segment_index(p.name) or 0 for p in segments), default=0)
        report = ReadReport()
        try:
            for path in reversed(segments):
                seqs = [record.seq for record in read_segment(path, report)]
                if seqs:
                    return max(seqs), last_index
            return 0, last_index
        finally:
            for damage in report.unreadable_segments:
                log.warning("fdr_segment_unreadable", segment=damage.segment, reason=damage.reason)

    # -- producer side (any thread) -------------------------------------------
    def record(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Queue a record; raises RecordPayloadError for an unknown kind or missing keys."""
        registered = kinds.validate(kind, payload)
        pending = _Pending(registered, dict(payload), self._wall_clock(), self._mono_clock())
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            self._drop(1, "queue full")

    def wait_durable(self, timeout: float) -> bool:
        """Block until every record queued before this call is on disk and synced."""
        marker = _Marker()
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.wait(timeout) and marker.durable

    def status(self) -> dict[str, Any]:
        segment = self._segment
        return {
            "directory": str(self._directory),
            "records_written": self.records_written,
            "records_dropped": self.records_dropped,
            "bytes_written": self.bytes_written,
            "syncs": self.syncs,
            "durable_seq": self.durable_seq,
            "queue_depth": self._queue.qsize(),
            "segment": segment.path.name if segment else None,
            "segments_deleted": self.segments_deleted,
            "last_error": self.last_error,
        }

    def _drop(self, count: int, reason: str) -> None:
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
        interval_s = self._config.fsync_interval_ms / 1000
        stopping = False
        while not stopping:
            timeout = None
            if dirty_since is not None:
                timeout = max(0.0, dirty_since + interval_s - time.monotonic())
            batch = self._take_batch(timeout)
            stopping = any(item is _STOP for item in batch)
            markers = [item for item in batch if isinstance(item, _Marker)]
            records = [item for item in batch if isinstance(item, _Pending)]
            failed = False
            if records:
                if self._write(records):
                    dirty_since = dirty_since if dirty_since is not None else time.monotonic()
                else:
                    failed, dirty_since = True, None  # the abandoned segment cannot be synced
            critical = any(item.kind.critical for item in records)
            due = dirty_since is not None and time.monotonic() - dirty_since >= interval_s
            if dirty_since is not None and (critical or due or markers or stopping):
                if self._sync():
                    dirty_since = None
                else:
                    failed, dirty_since = True, None
            for marker in markers:
                marker.durable = not failed and dirty_since is None
                marker.set()
        self._close_segment()

    def _take_batch(self, timeout: float | None) -> list[Any]:
        try:
            batch = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        while len(batch) < _BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _write(self, records: list[_Pending]) -> bool:
        """Append records; on failure drop the rest (counted) and abandon the segment.

        A batch goes to the file in one ``write`` per segment: a write releases
        the GIL, and a writer that wrote frame by frame would wait for it after
        every frame behind a busy Python thread (bench/fdr_throughput.py).
        """
        report = self._drop_report() if self._unreported_drops else None
        flushed: Counter[str] = Counter()
        frames: list[tuple[bytes, str, int]] = []  # (frame, "report"|"record"|"retention", seq)
        try:
            segment = self._segment_for_writing()
            size = segment.size
            for pending in [report, *records] if report else records:
                frame, seq = self._frame(pending)
                retention = None
                if size + len(frame) > self._config.segment_max_bytes and (
                    size > framing.SEGMENT_HEADER.size
                ):
                    flushed += self._flush(segment, frames)
                    frames = []
                    segment, retention = self._rotate()
                    size = segment.size
                frames.append((frame, "report" if pending is report else "record", seq))
                size += len(frame)
                if retention is not None:  # after the record whose seq came first
                    retention_frame, retention_seq = self._frame(retention)
                    frames.append((retention_frame, "retention", retention_seq))
                    size += len(retention_frame)
            flushed += self._flush(segment, frames)
        except OSError as exc:
            if not isinstance(exc, _BackingOff):
                self._fail(exc, "write")
            if report is not None and not flushed["report"]:
                with self._lock:  # the report was not written: report it (and why) later
                    self._unreported_drops += int(report.payload["dropped"])
                    self._drop_reasons.update(str(report.payload["reason"]).split("; "))
            self._drop(len(records) - flushed["record"], f"write failed: {exc.strerror or exc}")
            return False
        return True

    def _flush(self, segment: _Segment, frames: list[tuple[bytes, str, int]]) -> Counter[str]:
        """Write frames (in seq order) in one go; returns how many of each role were written."""
        if not frames:
            return Counter()
        data = b"".join(frame for frame, _, _ in frames)
        write_all(segment.fd, data)
        segment.size += len(data)
        self.bytes_written += len(data)
        self.records_written += len(frames)
        self._written_seq = frames[-1][2]
        return Counter(role for _, role, _ in frames)

    def _drop_report(self) -> _Pending:
        with self._lock:
            count, self._unreported_drops = self._unreported_drops, 0
            reasons, self._drop_reasons = sorted(self._drop_reasons), set()
        payload = {"dropped": count, "reason": "; ".join(reasons)}
        return _Pending(kinds.KINDS["fdr_dropped"], payload, self._wall_clock(), self._mono_clock())

    def _frame(self, pending: _Pending) -> tuple[bytes, int]:
        seq = next(self._seq)
        body = framing.encode_body(
            {
                "kind": pending.kind.name,
                "schema_version": pending.kind.schema_version,
                "seq": seq,
                "wall_ns": pending.wall_ns,
                "mono_ns": pending.mono_ns,
                "boot_id": self._boot_id,
                "payload": pending.payload,
            }
        )
        return framing.encode_frame(body), seq

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
        self.syncs += 1
        self.durable_seq = self._written_seq
        return True

    def _segment_for_writing(self) -> _Segment:
        if self._segment is not None:
            return self._segment
        failed_at = self._last_failure_mono_ns
        if failed_at is not None and self._mono_clock() - failed_at < _RETRY_AFTER_FAILURE_NS:
            raise _BackingOff(errno.EAGAIN, "recorder is backing off after a failure")
        return self._open_segment()

    def _open_segment(self) -> _Segment:
        index = self._next_index
        path = self._directory / framing.segment_name(index)
        fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
        self._next_index = index + 1
        try:
            header = framing.encode_segment_header(index, self._wall_clock())
            write_all(fd, header)
            os.fdatasync(fd)
            fsync_directory(self._directory)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()  # holds no record; on a full disk, retries would litter
            raise
        self._segment = _Segment(index, path, fd, len(header))
        return self._segment

    def _rotate(self) -> tuple[_Segment, _Pending | None]:
        """Close the full segment, apply the size cap, open the next one; returns
        the retention record to write if segments were deleted."""
        self._close_segment()
        deleted = self._enforce_size_cap()
        segment = self._open_segment()
        if not deleted:
            return segment, None
        names, size = deleted
        payload = {
            "deleted_segments": names,
            "deleted_bytes": size,
            "max_total_bytes": self._config.max_total_bytes,
        }
        retention = _Pending(
            kinds.KINDS["fdr_retention"], payload, self._wall_clock(), self._mono_clock()
        )
        return segment, retention

    def _enforce_size_cap(self) -> tuple[list[str], int] | None:
        """Delete the oldest closed segments until the next one fits under the cap."""
        segments = list_segments(self._directory)
        sizes = {path: path.lstat().st_size for path in segments}  # a symlink: not followed
        total = sum(sizes.values())
        budget = self._config.max_total_bytes - self._config.segment_max_bytes
        deleted: list[str] = []
        freed = 0
        for path in segments:
            if total - freed <= budget:
                break
            path.unlink()
            deleted.append(path.name)
            freed += sizes[path]
        if not deleted:
            return None
        fsync_directory(self._directory)
        self.segments_deleted += len(deleted)
        log.info("fdr_segments_deleted", segments=deleted, bytes=freed)
        return deleted, freed

    def _close_segment(self) -> None:
        segment, self._segment = self._segment, None
        if segment is None:
            return
        try:
            os.fdatasync(segment.fd)
            self.syncs += 1
            self.durable_seq = self._written_seq
        except OSError as exc:
            self.last_error = f"fdatasync on close: {exc}"
        finally:
            os.close(segment.fd)

    def _fail(self, exc: OSError, operation: str) -> None:
        self.last_error = f"{operation}: {exc}"
        self._last_failure_mono_ns = self._mono_clock()
        log.error("fdr_write_failed", operation=operation, error=str(exc))
        segment, self._segment = self._segment, None
        if segment is not None:
            with contextlib.suppress(OSError):
                os.close(segment.fd)
