"""The recorder's segment files on disk: naming, creating, and the size cap.

Everything here runs on the writer's thread (or before it starts)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

from inferd.config import FdrConfig
from inferd.durable import fsync_directory, write_all
from inferd.errors import InferdError
from inferd.fdr import framing
from inferd.fdr.inventory import Inventory
from inferd.fdr.reader import ReadReport, read_segment
from inferd.lock_files import lock_owned_file
from inferd.owned_files import open_nofollow

log = structlog.get_logger("inferd.fdr")

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND


#: Why the writer drops every record once it assigned seq ``framing.MAX_SEQ``: the
#: reader calls any later seq corrupt, so no record is written with one.
SEQS_SPENT = (
    f"no seq is left: {framing.MAX_SEQ}, the largest a record holds, is taken; move the "
    "segments away and restart the daemon"
)


class SeqsSpentError(OSError):
    """The writer's next seq is past ``framing.MAX_SEQ`` (a newest record just below
    it, crafted or made by hand, resumed from): a write failure, so the records are
    dropped and counted, and the outage raised once (``SEQS_SPENT``)."""


class CannotResumeError(InferdError):
    """What earlier runs left leaves the recorder nothing to go on from: a segment
    named for the largest index a header holds, or a record with the largest seq
    (made by hand, or crafted: a recorder would need over 2**63 records).  Going
    on would fail every write, for good; the daemon serves without its recorder
    and says why (``fdr_unavailable``)."""


@dataclass
class Segment:
    index: int
    path: Path
    fd: int
    size: int


def last_seq(newest_first: Iterable[Path]) -> int:
    """The last seq written, from the segments newest first.  A segment that cannot
    be read (a symlink, which is never followed) holds no seq to resume from; its
    index stays taken."""
    report = ReadReport()
    try:
        for path in newest_first:
            seqs = [record.seq for record in read_segment(path, report)]
            if seqs:
                return max(seqs)
        return 0
    finally:
        for damage in report.unreadable_segments:
            log.warning("fdr_segment_unreadable", segment=damage.segment, reason=damage.reason)


#: The recorder's lock file: not the instance lock's ``inferd.lock``, so that an
#: ``fdr.directory`` that is also the runtime dir does not lock out its own daemon.
LOCK_NAME = "fdr.lock"


class RecorderInUseError(CannotResumeError):
    """Another process records into the directory (its ``fdr.lock`` is locked): two
    recorders there would prune each other's segments, the other's records lost
    while it counts them durable, and repeat each other's seqs."""


def lock_directory(directory: Path) -> int:
    """The recorder's lock on ``directory`` (a descriptor, held until closed), taken
    before its scan; ``RecorderInUseError`` when another process holds it."""
    fd = lock_owned_file(directory / LOCK_NAME, note_pid=False)  # a full disk: still
    if fd is None:
        raise RecorderInUseError(
            f"another inferd records into {directory} (it holds {LOCK_NAME} there): two "
            "daemons must not share a flight data recorder directory (fdr.directory)"
        )
    return fd


def resume_point(directory: Path, inventory: Inventory) -> tuple[int, int]:
    """(next seq, next index) after the segments of ``inventory``, which the scan of
    ``directory`` found; CannotResumeError when either is past what a record or a
    segment header holds."""
    highest = inventory.highest_index
    if highest >= framing.MAX_SEGMENT_INDEX:
        name = framing.segment_name(highest)
        raise CannotResumeError(
            f"{directory / name}: a segment named for index {highest}, the largest a segment "
            "header holds, leaves the recorder no index to go on from; move that file away"
        )
    seq = last_seq(inventory.paths_newest_first(directory))
    if seq >= framing.MAX_SEQ:
        raise CannotResumeError(
            f"{directory}: its newest record has seq {seq}, the largest a record holds, which "
            "leaves the recorder no seq to go on from; move the newest segment away"
        )
    return seq + 1, highest + 1


def create(directory: Path, index: int, created_wall_ns: int) -> Segment | None:
    """A new, synced segment at ``index``; None when the name is taken (never
    overwritten: it is not ours, or an earlier run's).  The header is encoded
    first: an index no header holds (ValueError) costs no descriptor and no file."""
    header = framing.encode_segment_header(index, created_wall_ns)
    path = directory / framing.segment_name(index)
    try:
        fd = open_nofollow(path, _CREATE)
    except FileExistsError:
        return None
    try:
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


def create_next(
    directory: Path, index: int, wall_clock: Callable[[], int], inventory: Inventory
) -> Segment:
    """A new segment at ``index`` or, where that name is taken, the next free one,
    added to ``inventory``; so is a name found taken (someone else's file, made
    since the scan), as the scan would have counted it."""
    while (segment := create(directory, index, wall_clock())) is None:
        inventory.add_found(directory, index)
        index += 1
    inventory.append(segment.index, segment.size)
    return segment


def make_room(
    directory: Path,
    inventory: Inventory,
    deleted: list[tuple[str, int]],
    config: FdrConfig,
    full: int | None,
) -> None:
    """Before a new segment: delete the oldest until the closed ones and it fit
    ``max_total_bytes`` (each segment is at most ``segment_max_bytes``).  After the disk
    filled up below the cap (``full``: the last failure's errno, ``ENOSPC`` or
    ``EDQUOT``), and while there is still no room (``_no_room``), the oldest segment goes
    too, one holding any bytes (with the empty ones before it), never the newest (what
    led to now): the newest records matter most, as in any loop recorder.  One such
    round a failure, which the writer's backoff spaces a second apart, so a disk another
    component keeps filling costs one segment a second, never all at once."""
    budget = config.max_total_bytes - config.segment_max_bytes
    if full is not None and len(inventory) > 1 and _no_room(directory, config, full):
        budget = min(budget, inventory.total - inventory.first_held())
    delete_oldest(directory, inventory, budget, deleted)


def _no_room(directory: Path, config: FdrConfig, full: int) -> bool:
    """Whether the file system still has no room for a segment after ``full``: a quota
    (``EDQUOT``) does not show in ``statvfs``, so it is taken as still there; ``ENOSPC``
    is no inode left (where inodes are counted) or less free than a segment
    (``statvfs`` failing: no room)."""
    if full == errno.EDQUOT:
        return True
    try:
        info = os.statvfs(directory)
    except OSError:
        return True
    no_inode = info.f_files > 0 and info.f_favail == 0  # 0 files: not counted (vfat, btrfs)
    return no_inode or info.f_bavail * info.f_frsize < config.segment_max_bytes


def delete_oldest(
    directory: Path, inventory: Inventory, budget: int, deleted: list[tuple[str, int]]
) -> None:
    """Delete the oldest segments until the inventory's total is at most ``budget``
    bytes, appending each (name, size) to ``deleted`` as it goes: a failure part
    way leaves there what was deleted (it must still be reported).  O(segments
    deleted), never O(segments kept): the sizes are the inventory's.

    A segment found gone (someone removed it behind the writer's back) or no longer
    a file (a directory now has its name, which the reader skips) is dropped from
    the inventory: nothing was deleted, nothing is reported, the cap goes on.  Any
    other failure (``EACCES``, ``EROFS``, ``EIO``) raises, the segment kept in the
    inventory: no new segment is opened past a cap that cannot hold."""
    before = len(deleted)
    gone: list[str] = []
    while len(inventory) and inventory.total > budget:
        index, size = inventory.oldest()
        for name, part in inventory.files(index, size):  # one, but for names made by hand
            try:
                (directory / name).unlink()  # a symlink: the link itself, never its target
            except (FileNotFoundError, IsADirectoryError):
                gone.append(name)
            else:
                deleted.append((name, part))
        inventory.pop_oldest()
    fresh = deleted[before:]
    if fresh or gone:
        names = [name for name, _ in fresh]
        log.info(
            "fdr_segments_deleted",
            segments=names,
            bytes=sum(size for _, size in fresh),
            **({"already_gone": gone} if gone else {}),
        )
    if fresh:
        fsync_directory(directory)
