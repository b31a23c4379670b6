"""The writer's running inventory of its segments: index and size, oldest first.

The size cap used to list the directory and ``lstat`` every kept segment at each
rotation (15-28 us a segment on a loaded 2-core VM: 0.5-0.9 s at 32,768), on the
writer thread while records queued.  Now the directory is scanned once, when the
recorder starts (``scan``: the segments ``reader.list_segments`` lists, with their
``lstat`` sizes), and the writer keeps the inventory: each write sets the newest
segment's size, each new segment is appended, and the cap pops from the oldest
end, so a rotation costs the same whatever the number of segments kept.

Only this uid or root may change the directory (``ensure_owned_dir``); what they
change behind the writer's back leaves the inventory stale, on the safe side:

- a segment removed is still counted until it is the oldest; the cap then finds it
  gone, drops it and deletes nothing for it (``segments.delete_oldest``).  Until
  then the recorder keeps less than ``max_total_bytes`` on disk, never more.
- a segment added is counted from the next start (its scan finds it), or at once
  if the writer tries to create that name (``add_found``).
- a file named for an index in another spelling (``seg-1.fdr``, which
  ``list_segments`` lists too) is counted with that index and deleted with it.

Indices and sizes are kept in two arrays of 8-byte integers (16 bytes a segment:
2 MiB at ``MAX_FDR_SEGMENTS``, where tuples of ints took about 120 bytes each),
the oldest end advanced by an offset and compacted once half of them are gone.

Other threads (``status``, a metrics scrape) read only ``kept``: a tuple the writer
replaces whole after each change, so a reader never sees a count from after a pop
with a total from before it, nor the arrays mid-compaction, and takes no lock.
"""

from __future__ import annotations

import os
import stat
from array import array
from collections.abc import Iterator
from pathlib import Path

from inferd.fdr import framing

#: Popped entries kept before the arrays are compacted (and never more than half).
_COMPACT_AFTER = 4096


#: (segments, total bytes, oldest index or None): what the inventory holds, as one
#: value another thread can read.  A plain tuple: a NamedTuple's constructor took
#: 0.5 us more, on every write.
Kept = tuple[int, int, int | None]


class Inventory:
    def __init__(self) -> None:
        self._indices = array("Q")  # a segment index is at most 2**64-1 (framing)
        self._sizes = array("q")
        self._head = 0  # entries before it were popped
        #: Bytes the segments in the inventory take (their ``lstat`` sizes).
        self.total = 0
        #: The highest index any entry's name took at the scan, a directory's too.
        self.highest_index = 0
        #: Count, total and oldest index, replaced whole after each change (above).
        self.kept: Kept = (0, 0, None)
        #: The files the scan found for an index under another spelling of its name
        #: (``seg-1.fdr``, someone's copy: ``segment_index`` reads it as 1), each with
        #: its size, the writer's own name too if found: counted and deleted together.
        #: Empty but for such hand-made names, so nothing is kept per segment.
        self._spelled: dict[int, tuple[tuple[str, int], ...]] = {}

    def __len__(self) -> int:
        return len(self._indices) - self._head

    @classmethod
    def scan(cls, directory: Path) -> Inventory:
        """What ``directory`` holds: every entry with a segment's name but a
        directory (symlinks included, never followed), as ``list_segments``; and
        the highest index taken by any name (a directory's name cannot be created,
        so it stays taken).  One listing and one ``lstat`` per segment."""
        found: list[tuple[int, str, int]] = []
        highest = 0
        with os.scandir(directory) as entries:
            for entry in entries:
                index = framing.segment_index(entry.name)
                if index is None:
                    continue
                highest = max(highest, index)
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # deleted meanwhile
                    continue
                if not stat.S_ISDIR(info.st_mode):
                    found.append((index, entry.name, info.st_size))
        inventory = cls()
        found.sort()
        previous = None
        for index, name, size in found:
            if index == previous:  # another name of it: one entry, its files listed
                files = (*inventory.files(index, inventory._sizes[-1]), (name, size))
                inventory._sizes[-1] += size
                inventory.total += size
                inventory._spelled[index] = files
                continue
            inventory._add(index, size)
            if name != framing.segment_name(index):
                inventory._spelled[index] = ((name, size),)
            previous = index
        inventory.highest_index = highest
        inventory._publish()
        return inventory

    def append(self, index: int, size: int) -> None:
        """A segment newer than every one held (the writer's indices only grow)."""
        self._add(index, size)
        self._publish()

    def _add(self, index: int, size: int) -> None:
        if len(self) and index <= self._indices[-1]:
            raise ValueError(f"segment {index} is not newer than {self._indices[-1]}")
        self._indices.append(index)
        self._sizes.append(size)
        self.total += size

    def _publish(self) -> None:
        count = len(self._indices) - self._head
        self.kept = (count, self.total, self._indices[self._head] if count else None)

    def add_found(self, directory: Path, index: int) -> None:
        """The writer found ``index``'s name taken (someone else's file, made after
        the scan): counted as the scan would have (``lstat``; a directory is not).
        Once: a name found taken again (a create that failed, then retried) is held."""
        if len(self) and index <= self._indices[-1]:
            return
        try:
            info = (directory / framing.segment_name(index)).lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(info.st_mode):
            self.append(index, info.st_size)

    def first_held(self) -> int:
        """The bytes of the oldest segments up to the first that holds any (the empty
        ones a crash between a segment's creation and its header left, then it), the
        newest left out: what deleting the oldest that holds bytes frees."""
        freed = 0
        for size in self._sizes[self._head : len(self._sizes) - 1]:
            freed += size
            if size:
                break
        return freed

    def set_newest_size(self, size: int) -> None:
        """The newest segment (the one being written) is now ``size`` bytes."""
        self.total += size - self._sizes[-1]
        self._sizes[-1] = size
        self._publish()

    def oldest(self) -> tuple[int, int]:
        """(index, size) of the oldest segment; ``IndexError`` when there is none."""
        if not len(self):
            raise IndexError("no segment")
        return self._indices[self._head], self._sizes[self._head]

    def files(self, index: int, size: int) -> tuple[tuple[str, int], ...]:
        """The files of segment ``index`` (``size`` bytes in all) with their sizes:
        its name, or those the scan found for it (``_spelled``)."""
        return self._spelled.get(index) or ((framing.segment_name(index), size),)

    def pop_oldest(self) -> None:
        index, size = self.oldest()
        self.total -= size
        if self._spelled:
            self._spelled.pop(index, None)
        self._head += 1
        if self._head >= _COMPACT_AFTER and self._head * 2 >= len(self._indices):
            # Amortised: each entry moves at most once per entry popped before it.
            del self._indices[: self._head]
            del self._sizes[: self._head]
            self._head = 0
        self._publish()

    def paths_newest_first(self, directory: Path) -> Iterator[Path]:
        for position in range(len(self._indices) - 1, self._head - 1, -1):
            for name, _size in reversed(self.files(self._indices[position], 0)):
                yield directory / name
