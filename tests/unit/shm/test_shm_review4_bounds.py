"""What a fourth review of the shared-memory path found in the registration's
bounds and the listener (``inferd.shm.regions``, ``inferd.shm.memfd``,
``inferd.shm.server``), on real memfds and real sockets."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import resource
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd.config import ShmConfig
from inferd.shm.server import ShmServer
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, make_memfd, wait_until
from tests.unit.shm.test_regions import Table

TIB = 1024**4


def vm_peak_bytes() -> int:
    """The most address space this process ever had mapped (``VmPeak``)."""
    status = Path("/proc/self/status").read_text()
    found = re.search(r"^VmPeak:\s+(\d+) kB$", status, re.MULTILINE)
    assert found is not None
    return int(found.group(1)) * 1024


@pytest.fixture
def table() -> Iterator[Table]:
    made = Table()  # the default bounds: 512 MiB per uid, 1 GiB in all
    yield made
    made.close()


@pytest.mark.parametrize("size", [32 * TIB, 2**62], ids=["32TiB", "4EiB"])
def test_a_region_past_the_byte_bounds_is_refused_before_it_is_mapped(
    table: Table, size: int
) -> None:
    """A sealed sparse memfd costs its client nothing whatever its size.  The daemon
    mapped it and only then compared its size with the bounds: 32 TiB of its
    address space (a quarter of x86-64's, all of a 39-bit arm64 kernel's) were
    taken from its other threads, which allocate meanwhile, for each such
    registration, and one past the address space was refused as "cannot map the
    region now" instead of by the bound it breaks."""
    fd = make_memfd(size, fcntl.F_SEAL_SHRINK)
    table.fds.append(fd)
    peak = vm_peak_bytes()
    with pytest.raises(ProtocolError) as refused:
        table.table.register(table.connection, fd, "huge")
    assert refused.value.code == Code.RESOURCE_EXHAUSTED
    assert "shm.max_bytes_per_uid" in refused.value.message
    assert vm_peak_bytes() < peak + TIB  # it was never mapped, even for a moment
    assert table.table.status()["mapped_bytes"] == 0
    assert table.connection.held == 0


@contextmanager
def descriptors_exhausted() -> Iterator[None]:
    """Every descriptor number this process may open is taken (its soft limit
    lowered to 64, then filled), until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(64, soft), hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_accept_that_fails_for_want_of_descriptors_is_not_retried_in_a_loop(
    short_tmp_path: Path,
) -> None:
    """``accept`` failing with ``EMFILE`` leaves the connection queued and the
    listener readable: the registration thread tried again at once, logging a
    traceback each time (64,699 in a second, a core busy).  It now leaves the
    listener for a pause, and accepts the connection once descriptors are free."""
    server = ShmServer(ShmConfig(socket=short_tmp_path / "shm.sock"))
    server.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # made before they run out
    try:
        with capture_logs() as logs:
            with descriptors_exhausted():
                client.connect(str(short_tmp_path / "shm.sock"))  # queued in the backlog

                def failed_accepts() -> int:
                    events = {"shm_accept_failed", "shm_handler_failed"}
                    return sum(1 for line in list(logs) if line["event"] in events)

                wait_until(failed_accepts, HANG_S, message="an accept that failed")
                time.sleep(0.3)  # a window to count the attempts in, not a wait for one
                attempts = failed_accepts()
            assert attempts <= 2, f"{attempts} failed accepts in 0.3 s"
            wait_until(lambda: len(server.connections) == 1, HANG_S, message="the accept")
        assert [line["event"] for line in logs if line["event"] == "shm_handler_failed"] == []
    finally:
        client.close()
        server.stop()
