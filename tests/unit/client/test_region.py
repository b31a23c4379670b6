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

import numpy as np
import pytest

from inferd_client.errors import ClientError
from inferd_client.region import SharedRegion

PAGE = mmap.PAGESIZE
ALL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def memfd(size: int, seals: int = 0) -> int:
    fd = os.memfd_create("camera-frames", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def is_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_an_unsealed_memfd_is_sealed_on_adoption_and_can_no_longer_shrink() -> None:
    with SharedRegion.adopt(memfd(2 * PAGE), label="camera") as region:
        assert region.nbytes == 2 * PAGE and region.label == "camera"
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) & ALL_SEALS == ALL_SEALS
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, PAGE)
        frame = region.array((2, PAGE // 4), np.float32)
        frame[...] = 7.0
        assert region.locate(frame) == (0, 2 * PAGE)


def test_a_memfd_already_sealed_against_shrinking_is_taken_as_it_is() -> None:
    with SharedRegion.adopt(memfd(PAGE, fcntl.F_SEAL_SHRINK)) as region:
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) == fcntl.F_SEAL_SHRINK


def test_what_another_process_wrote_is_what_the_adopted_region_reads() -> None:
    fd = memfd(PAGE)
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


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (_pipe, "must be a memfd created with MFD_ALLOW_SEALING"),
        (_plain_file, "must be a memfd created with MFD_ALLOW_SEALING"),
        (lambda: memfd(PAGE + 1), f"holds {PAGE + 1} bytes"),
        (lambda: memfd(0), "holds 0 bytes"),
        (lambda: memfd(PAGE, fcntl.F_SEAL_SEAL), "sealed against shrinking or still sealable"),
        (lambda: memfd(PAGE, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE), "mapped read-write"),
    ],
    ids=["pipe", "plain-file", "odd-size", "empty", "sealed-unsealable", "write-sealed"],
)
def test_what_cannot_be_a_region_is_refused_and_its_descriptor_closed(
    make: Callable[[], int], fragment: str
) -> None:
    fd = make()
    with pytest.raises(ClientError, match=fragment):
        SharedRegion.adopt(fd)
    assert is_closed(fd)
