"""Mapping a client's memfd (``inferd.shm.memfd``): only a memfd sealed against
shrinking, so that nothing the client does afterwards can fault the daemon."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.shm.memfd import F_GET_SEALS, F_SEAL_SHRINK, map_sealed_memfd
from inferd_wire import regions
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import make_memfd, transparent_huge_pages, vm_flags

PAGE_SIZE = mmap.PAGESIZE

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def memfd(size: int = 4 * PAGE_SIZE, seals: int = SEALS) -> int:
    return make_memfd(size, seals)


@pytest.fixture
def fds() -> Iterator[list[int]]:
    opened: list[int] = []
    yield opened
    for fd in opened:
        os.close(fd)


def refused(fd: int, fragment: str, code: Code = Code.INVALID_ARGUMENT) -> None:
    with pytest.raises(ProtocolError) as caught:
        map_sealed_memfd(fd)
    assert caught.value.code == code
    assert fragment in caught.value.message


def test_the_constants_are_the_kernels() -> None:
    # include/uapi/linux/fcntl.h: F_LINUX_SPECIFIC_BASE + 10, and 0x0002.
    assert (F_GET_SEALS, F_SEAL_SHRINK) == (1024 + 10, 0x0002)


def test_a_sealed_memfd_is_mapped_shared_and_survives_what_the_client_can_do(
    fds: list[int],
) -> None:
    fd = memfd()
    fds.append(fd)
    mapping, size = map_sealed_memfd(fd)
    assert size == 4 * PAGE_SIZE
    client = mmap.mmap(fd, size)
    client[:5] = b"hello"
    assert mapping[:5] == b"hello"  # the same pages
    with pytest.raises(PermissionError):
        os.ftruncate(fd, PAGE_SIZE)  # sealed: the kernel refuses to shrink it
    client.close()  # the client unmaps its own mapping: the daemon's stays
    assert mapping[:5] == b"hello" and mapping[size - 1] == 0
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    if transparent_huge_pages():  # an output's pages may be the daemon's to place
        assert "hg" in vm_flags(address)
    mapping.close()


def test_the_shmem_huge_page_policy_is_the_kernels_selected_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = tmp_path / "shmem_enabled"
    policy.write_text("always within_size [advise] never deny force\n")
    monkeypatch.setattr(regions, "SHMEM_HUGE_PAGES", policy)
    assert regions.shmem_huge_pages() == "advise"
    policy.unlink()
    assert regions.shmem_huge_pages() == "unavailable"


@pytest.mark.parametrize(
    "seals", [0, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SEAL], ids=["none", "grow", "seal"]
)
def test_a_memfd_not_sealed_against_shrinking_is_refused(fds: list[int], seals: int) -> None:
    fd = memfd(seals=seals)
    fds.append(fd)
    refused(fd, "F_SEAL_SHRINK")


def test_other_descriptors_are_refused(fds: list[int]) -> None:
    with tempfile.TemporaryFile() as regular:
        regular.truncate(PAGE_SIZE)
        refused(regular.fileno(), "not a memfd")
    read, write = os.pipe()
    fds += [read, write]
    refused(read, "not a memfd")


def test_sizes_that_are_not_whole_pages_are_refused(fds: list[int]) -> None:
    for size in (0, PAGE_SIZE + 1):
        fd = memfd(size=size)
        fds.append(fd)
        refused(fd, "multiple of the page size")


def test_a_hugetlbfs_memfd_is_refused_before_it_is_mapped(fds: list[int]) -> None:
    """Its pages can be punched out by the client and come back only from a pool
    that may be empty: the daemon's next touch would be a SIGBUS."""
    huge = 2 * 1024 * 1024
    try:
        fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    except OSError as exc:
        pytest.skip(f"this kernel makes no hugetlbfs memfd: {exc.strerror}")
    fds.append(fd)
    os.ftruncate(fd, huge)  # no huge page is taken before it is touched
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    refused(fd, "MFD_HUGETLB")


def test_a_memfd_that_cannot_be_mapped_read_write_is_refused(fds: list[int]) -> None:
    fd = memfd()
    fds.append(fd)
    read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    fds.append(read_only)
    refused(read_only, "read-write")
    sealed = memfd(seals=0)
    fds.append(sealed)
    fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    refused(sealed, "read-write")


def test_without_the_seal_truncating_the_memfd_would_kill_the_reader() -> None:
    """Why the seal is required: a process reading a mapping of an unsealed memfd
    that another truncates dies of SIGBUS (here a child stands in for the daemon)."""
    script = """
import mmap, os
fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 8 * mmap.PAGESIZE)
mapping = mmap.mmap(fd, 8 * mmap.PAGESIZE)
os.ftruncate(fd, 0)  # what a client could do to it
print(mapping[7 * mmap.PAGESIZE])
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30)
    assert child.returncode == -signal.SIGBUS


def test_a_memfd_whose_seals_are_locked_gets_advice_it_can_follow(fds: list[int]) -> None:
    """Made without ``MFD_ALLOW_SEALING``, a memfd carries ``F_SEAL_SEAL``: the
    ``F_ADD_SEALS`` the refusal used to advise fails with ``EPERM`` there."""
    fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC)
    fds.append(fd)
    os.ftruncate(fd, PAGE_SIZE)
    with pytest.raises(ProtocolError) as caught:
        map_sealed_memfd(fd)
    message = caught.value.message
    assert caught.value.code == Code.INVALID_ARGUMENT
    assert "can no longer be" in message and "F_SEAL_SEAL" in message, message
    assert "memfd_create(MFD_ALLOW_SEALING), add F_SEAL_SHRINK, then register" in message
    assert "F_ADD_SEALS" not in message
    with pytest.raises(PermissionError):  # why: the old advice, followed
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    # What it says to do instead is what the daemon takes.
    remade = make_memfd(PAGE_SIZE, fcntl.F_SEAL_SHRINK)
    fds.append(remade)
    mapping, size = map_sealed_memfd(remade)
    mapping.close()
    assert size == PAGE_SIZE


def test_a_dev_shm_file_is_refused_as_a_tmpfs_file_not_as_a_memfd() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm on this host")
    with tempfile.TemporaryFile(dir=shm) as tmpfs_file:
        fd = tmpfs_file.fileno()
        os.ftruncate(fd, PAGE_SIZE)
        try:
            seals = fcntl.fcntl(fd, F_GET_SEALS)
        except OSError:
            pytest.skip("/dev/shm is not a tmpfs mount here")
        assert seals & fcntl.F_SEAL_SEAL  # every tmpfs file's seals are locked
        with pytest.raises(ProtocolError) as caught:
            map_sealed_memfd(fd)
    message = caught.value.message
    assert caught.value.code == Code.INVALID_ARGUMENT
    assert message.startswith("the descriptor is a file of a tmpfs mount"), message
    assert "not a memfd" in message and "memfd_create(MFD_ALLOW_SEALING)" in message
    assert "the memfd" not in message and "F_ADD_SEALS" not in message


def test_an_o_path_descriptor_is_told_to_pass_the_memfd_itself(fds: list[int]) -> None:
    fd = memfd()
    fds.append(fd)
    path_only = os.open(f"/proc/self/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    fds.append(path_only)
    refused(path_only, "opened with O_PATH?): pass the memfd itself")
