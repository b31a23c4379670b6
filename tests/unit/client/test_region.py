"""``SharedRegion.adopt``: a memfd another process made becomes a region, sealed as
the daemon requires, or is refused with its reason and its descriptor closed."""

from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from inferd_client.errors import ClientError, InvalidArgument
from inferd_client.region import SharedRegion
from tests.conftest import make_memfd

PAGE = mmap.PAGESIZE
ALL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def is_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_an_unsealed_memfd_is_sealed_on_adoption_and_can_no_longer_shrink() -> None:
    with SharedRegion.adopt(make_memfd(2 * PAGE), label="camera") as region:
        assert region.nbytes == 2 * PAGE and region.label == "camera"
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) & ALL_SEALS == ALL_SEALS
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, PAGE)
        frame = region.array((2, PAGE // 4), np.float32)
        frame[...] = 7.0
        assert region.locate(frame) == (0, 2 * PAGE)


def test_a_memfd_already_sealed_against_shrinking_is_taken_as_it_is() -> None:
    with SharedRegion.adopt(make_memfd(PAGE, fcntl.F_SEAL_SHRINK)) as region:
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) == fcntl.F_SEAL_SHRINK


def test_what_another_process_wrote_is_what_the_adopted_region_reads() -> None:
    fd = make_memfd(PAGE)
    writer = "import os, sys; os.pwrite(int(sys.argv[1]), bytes(range(256)) * 16, 0)"
    subprocess.run([sys.executable, "-c", writer, str(fd)], pass_fds=[fd], check=True)
    with SharedRegion.adopt(fd) as region:
        assert region.array(PAGE, np.uint8).tobytes() == bytes(range(256)) * 16


def _pipe() -> int:
    read, write = os.pipe()
    os.close(write)
    return read


def _plain_file() -> int:
    with tempfile.TemporaryFile() as handle:
        handle.truncate(PAGE)
        return os.dup(handle.fileno())


def _read_only() -> int:
    fd = make_memfd(PAGE)
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (_pipe, "must be a memfd"),
        (_plain_file, "must be a memfd"),
        (lambda: make_memfd(PAGE + 1), f"holds {PAGE + 1} bytes"),
        (lambda: make_memfd(0), "holds 0 bytes"),
        (lambda: make_memfd(PAGE, fcntl.F_SEAL_SEAL), "cannot be sealed against shrinking"),
        (
            lambda: make_memfd(PAGE, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE),
            "sealed against writing",
        ),
        (_read_only, "not open read-write"),
    ],
    ids=[
        "pipe",
        "plain-file",
        "odd-size",
        "empty",
        "sealed-unsealable",
        "write-sealed",
        "read-only",
    ],
)
def test_what_cannot_be_a_region_is_refused_and_its_descriptor_closed(
    make: Callable[[], int], fragment: str
) -> None:
    fd = make()
    with pytest.raises(ClientError, match=fragment):
        SharedRegion.adopt(fd)
    assert is_closed(fd)


@pytest.mark.parametrize(
    ("size", "seals", "opened"),
    [
        (PAGE + 1, 0, os.O_RDWR),
        (0, 0, os.O_RDWR),
        (PAGE, 0, os.O_RDONLY),
        (PAGE, fcntl.F_SEAL_WRITE, os.O_RDWR),
    ],
    ids=["odd-size", "empty", "read-only", "write-sealed"],
)
def test_a_refused_memfd_is_left_to_its_maker_unsealed(size: int, seals: int, opened: int) -> None:
    """Seals belong to the memfd: a refusal must not leave the maker's buffer sealed
    (an empty one, sent before its maker sized it, could never grow)."""
    maker = make_memfd(size, seals)
    try:
        handed = os.open(f"/proc/self/fd/{maker}", opened | os.O_CLOEXEC)
        with pytest.raises(ClientError):
            SharedRegion.adopt(handed)
        assert fcntl.fcntl(maker, fcntl.F_GET_SEALS) == seals
        os.ftruncate(maker, 4 * PAGE)  # the maker can still size it
    finally:
        os.close(maker)


def test_a_descriptor_that_is_not_open_is_refused_as_such() -> None:
    fd = make_memfd(PAGE)
    os.close(fd)
    for bad in (fd, -1):
        with pytest.raises(ClientError, match="cannot be a region"):
            SharedRegion.adopt(bad)


@pytest.mark.parametrize("shape", [(-1, 1000), (2, -3), -4])
def test_a_refused_array_takes_nothing_from_the_region(shape: Any) -> None:
    """A negative dimension makes a negative size that passed the bounds check and
    moved the allocator back over arrays already handed out."""
    with SharedRegion(8192) as region:
        first = region.array(100, np.uint8)
        with pytest.raises(InvalidArgument, match="negative"):
            region.array(shape, np.float32)
        later = [region.locate(region.array(64, np.uint8)) for _ in range(16)]
        assert region.locate(first) == (0, 100)
        assert later[0] == (256, 64)  # after the first, none aliasing it
