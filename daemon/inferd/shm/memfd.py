"""Mapping a memfd a client handed over, so that nothing the client does later can
fault the daemon.

A mapping of a file faults (SIGBUS) when the daemon touches a page that lies
beyond the file's end: a client that truncates its file under the daemon's
reads would kill it.  A memfd sealed with ``F_SEAL_SHRINK`` can never become
smaller (seals are a property of the inode and can never be removed:
fcntl(2), memfd_create(2)), so once the seals say so the size ``fstat`` reports
stays mapped for as long as the daemon maps it; growing it is harmless, the
mapping keeps its length.  Wayland's ``wl_shm`` pools rely on the same rule.
The seals are read *before* the size, so no truncation can slip in between.
What the client may still do: write the memory at any time (torn tensors are
the client's concern, never a fault of the daemon's), unmap its own mapping or
close its descriptor (the daemon's mapping keeps the pages).

Nor may the kernel's accounting fault it.  A memfd is ``VM_NORESERVE``: its
pages are charged to the system's commit only as they are first touched
(``mm/shmem.c`` ``shmem_acct_blocks``), and a charge refused there is reported
as ``-ENOSPC``, which a page fault turns into SIGBUS ("so that a failure on a
sparse tmpfs mapping will give SIGBUS not OOM").  Under the default heuristic
overcommit (``vm.overcommit_memory`` 0) and under 1, a page's charge is never
refused; under strict overcommit (2) it is refused once the system's commit is
at ``CommitLimit``, which any process can bring about, and a client's sparse
(ftruncated, never written) or hole-punched page is then a SIGBUS in whichever
daemon thread reads an input or writes an output there.  Pre-faulting at
registration would not help (the client may punch the hole later; sealing
against it needs ``F_SEAL_WRITE``, which forbids outputs), so ``shm.sock`` is
not served at all under strict overcommit (``strict_overcommit``).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import stat
from collections.abc import Callable
from pathlib import Path

from inferd_wire.protocol import Code, ProtocolError
from inferd_wire.regions import advise_huge_pages, region_size_problem

#: The kernel's values, exported by Python's ``fcntl`` since 3.8 (bpo-26835);
#: ``include/uapi/linux/fcntl.h``: F_LINUX_SPECIFIC_BASE (1024) + 10, and 0x0002.
F_GET_SEALS: int = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SHRINK: int = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
#: No seal can be added any more: set by ``memfd_create`` without
#: ``MFD_ALLOW_SEALING``, and on every other tmpfs file (``/dev/shm``).
F_SEAL_SEAL: int = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
#: What ``memfd_create`` names every file it makes (``mm/memfd.c``
#: ``MFD_NAME_PREFIX``), as ``/proc/self/fd`` shows it: ``/memfd:NAME (deleted)``.
MEMFD_PATH_PREFIX = "/memfd:"
#: The kernel's overcommit policy: 0 heuristic, 1 always, 2 strict (``OVERCOMMIT_NEVER``).
OVERCOMMIT_MEMORY = Path("/proc/sys/vm/overcommit_memory")
OVERCOMMIT_NEVER = 2


def refused(message: str) -> ProtocolError:
    return ProtocolError(Code.INVALID_ARGUMENT, message)


def seal_state(fd: int) -> int:
    """The file's seals; INVALID_ARGUMENT when it cannot carry any (not a memfd) or
    the descriptor cannot be used for them (``O_PATH``)."""
    try:
        return fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise refused(
                "the descriptor is not a memfd (F_GET_SEALS: EINVAL): create the region "
                "with memfd_create(MFD_ALLOW_SEALING)"
            ) from None
        if exc.errno == errno.EBADF:  # the daemon holds it open: only O_PATH is left
            raise refused(
                "the descriptor cannot be used for its file's seals or memory (F_GET_SEALS: "
                "EBADF; opened with O_PATH?): pass the memfd itself, as memfd_create "
                "returned it or reopened read-write"
            ) from None
        raise refused(f"the descriptor's seals cannot be read: {exc.strerror}") from None


def is_memfd(fd: int) -> bool:
    """Whether ``fd`` is a file that can carry seals (a memfd, shared memory)."""
    try:
        fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:
        return False
    return True


def made_by_memfd_create(fd: int) -> bool:
    """Whether ``fd``'s file came from ``memfd_create`` (by the name the kernel gave
    it); True when ``/proc`` cannot say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(MEMFD_PATH_PREFIX)
    except OSError:
        return True


@functools.cache
def shmem_device() -> int:
    """The device of every ordinary memfd (the kernel's internal shmem mount), read
    from one made here; a hugetlbfs memfd lies on another."""
    fd = os.memfd_create("inferd-probe", os.MFD_CLOEXEC)
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def map_sealed_memfd(
    fd: int, admit_size: Callable[[int], None] = lambda _size: None
) -> tuple[mmap.mmap, int]:
    """Map ``fd`` shared and read-write; returns the mapping and its size.

    Refused (``ProtocolError`` INVALID_ARGUMENT, nothing mapped) unless it is a
    memfd sealed with ``F_SEAL_SHRINK``, a regular file of ordinary shared memory
    (not hugetlbfs) of a positive size that is a multiple of the page size (what
    CUDA registers), opened read-write and not sealed against writing.
    ``admit_size`` may refuse the size (its ``ProtocolError``) before anything is
    mapped: a sparse memfd of 64 TiB costs its client nothing, and mapped even for
    a moment it would take half the daemon's address space from its other threads.
    The caller keeps ownership of ``fd``.  What kind of file it is is checked before
    its seals, so that the advice on the seals is advice for a memfd."""
    seals = seal_state(fd)
    info = os.fstat(fd)  # after the seals: the size below is one F_SEAL_SHRINK keeps
    if not stat.S_ISREG(info.st_mode):
        raise refused("the descriptor is not a regular memfd")
    if info.st_dev != shmem_device():
        if not made_by_memfd_create(fd):  # a file of a tmpfs mount: /dev/shm, shm_open
            raise refused(
                "the descriptor is a file of a tmpfs mount (/dev/shm, shm_open), not a memfd: "
                "its seals are locked, so it can never be sealed against shrinking; create "
                "the region with memfd_create(MFD_ALLOW_SEALING)"
            )
        # hugetlbfs (MFD_HUGETLB): a page its client punches out comes back from a
        # pool that may be empty, and the daemon's touch would be a SIGBUS.
        raise refused(
            "the memfd is not ordinary shared memory (made with MFD_HUGETLB?): a region "
            "must be (it may still use transparent huge pages)"
        )
    if not seals & F_SEAL_SHRINK:
        if seals & F_SEAL_SEAL:  # F_ADD_SEALS fails with EPERM: no advice to add one
            raise refused(
                f"the memfd is not sealed against shrinking and can no longer be (seals "
                f"{seals:#x}: F_SEAL_SEAL {F_SEAL_SEAL:#x} set, F_SEAL_SHRINK {F_SEAL_SHRINK:#x} "
                "missing; made without MFD_ALLOW_SEALING?): create the region with "
                "memfd_create(MFD_ALLOW_SEALING), add F_SEAL_SHRINK, then register it"
            )
        raise refused(
            f"the memfd is not sealed against shrinking (seals {seals:#x}, F_SEAL_SHRINK "
            f"{F_SEAL_SHRINK:#x} missing): add it with fcntl(F_ADD_SEALS) before registering, "
            "so that truncating it can never fault the daemon"
        )
    size = info.st_size
    problem = region_size_problem(size)
    if problem is not None:
        raise refused(problem)
    admit_size(size)
    try:
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except PermissionError:
        raise refused(
            "the memfd cannot be mapped read-write (opened read-only, or sealed against "
            "writing): outputs are written into regions"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            raise ProtocolError(
                Code.RESOURCE_EXHAUSTED, f"the daemon cannot map the region now: {exc.strerror}"
            ) from None
        raise refused(f"the memfd cannot be mapped: {exc.strerror}") from None
    advise_huge_pages(mapping)  # the daemon may touch an output's pages first
    return mapping, size


def strict_overcommit(path: Path = OVERCOMMIT_MEMORY) -> str | None:
    """Why clients' memfds may not be mapped on this host (the module docstring):
    the policy read from ``path`` is strict overcommit; else None.  ``OSError`` or
    ``ValueError`` when it cannot be read (no ``/proc/sys`` in a sandbox)."""
    policy = int(path.read_text())
    if policy != OVERCOMMIT_NEVER:
        return None
    return (
        f"the kernel's overcommit policy is strict (vm.overcommit_memory = {policy}): a "
        "page of a client's memfd is charged to the system's commit when the daemon first "
        "touches it, and a refused charge is a SIGBUS that would end the daemon, so shm.sock "
        "is not served (tensors go as frames on the infer socket); set vm.overcommit_memory "
        "to 0 or 1 and restart inferd to use shared memory"
    )
