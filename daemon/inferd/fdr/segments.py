"""The recorder's segment files on disk: naming, creating, and the size cap.

Everything here runs on the writer's thread (or before it starts)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from inferd.durable import fsync_directory, write_all
from inferd.fdr import framing
from inferd.fdr.reader import ReadReport, list_segments, read_segment
from inferd.owned_files import open_nofollow

log = structlog.get_logger("inferd.fdr")

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND


@dataclass
class Segment:
    index: int
    path: Path
    fd: int
    size: int


def last_seq(directory: Path) -> int:
    """The last seq written.  A segment that cannot be read (a symlink, which is
    never followed) holds no seq to resume from; its index stays taken."""
    report = ReadReport()
    try:
        for path in reversed(list_segments(directory)):
            seqs = [record.seq for record in read_segment(path, report)]
            if seqs:
                return max(seqs)
        return 0
    finally:
        for damage in report.unreadable_segments:
            log.warning("fdr_segment_unreadable", segment=damage.segment, reason=damage.reason)


def highest_index(directory: Path) -> int:
    """The highest index any entry's name takes, a directory's too: the reader
    skips directories, but their names cannot be created, so they stay taken."""
    names = os.listdir(directory)
    return max((framing.segment_index(name) or 0 for name in names), default=0)


def create(directory: Path, index: int, created_wall_ns: int) -> Segment | None:
    """A new, synced segment at ``index``; None when the name is taken (never
    overwritten: it is not ours, or an earlier run's)."""
    path = directory / framing.segment_name(index)
    try:
        fd = open_nofollow(path, _CREATE)
    except FileExistsError:
        return None
    try:
        header = framing.encode_segment_header(index, created_wall_ns)
        write_all(fd, header)
        os.fdatasync(fd)
        fsync_directory(directory)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()  # holds no record; on a full disk, retries would litter
        raise
    return Segment(index, path, fd, len(header))


def append(segment: Segment, data: bytes) -> None:
    """Write ``data`` at the segment's end.  ``segment.size`` counts every byte
    written, also when a write fails part way (a short write, then ENOSPC)."""
    view = memoryview(data)
    while view:
        written = os.write(segment.fd, view)
        segment.size += written
        view = view[written:]


def create_next(directory: Path, index: int, wall_clock: Callable[[], int]) -> Segment:
    """A new segment at ``index`` or, where that name is taken, the next free one."""
    while (segment := create(directory, index, wall_clock())) is None:
        index += 1
    return segment


def delete_oldest(directory: Path, budget: int, deleted: list[tuple[str, int]]) -> None:
    """Delete the oldest segments until what is left takes at most ``budget``
    bytes, appending each (name, size) to ``deleted`` as it goes: a failure part
    way leaves there what was deleted (it must still be reported)."""
    segments = list_segments(directory)
    sizes = {path: path.lstat().st_size for path in segments}  # a symlink: not followed
    total = sum(sizes.values())
    before = len(deleted)
    for path in segments:
        if total <= budget:
            break
        path.unlink()
        deleted.append((path.name, sizes[path]))
        total -= sizes[path]
    if len(deleted) > before:
        fresh = deleted[before:]
        names = [name for name, _ in fresh]
        log.info("fdr_segments_deleted", segments=names, bytes=sum(size for _, size in fresh))
        fsync_directory(directory)
