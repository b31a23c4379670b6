"""A flood of raw connections that never send their ZeroMQ greeting, against a
real daemon with a low limit on open descriptors (DESIGN.md 128).

Such a connection never reaches the ZAP handler, so ``bus.max_connections`` does
not bound it; without the descriptor guard libzmq's ``ipc://`` listener aborts the
daemon (SIGABRT) once an accept finds no descriptor left (about 8,150 connections,
0.4 s here, at a limit of 8,192)."""

from __future__ import annotations

import collections
import resource
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd_client import InferenceClient, OperatorClient
from tests.conftest import HANG_S, DaemonProcess, render_config, start_daemon, wait_until
from tests.integration.wire import IDENTITY_SHAPE

pytestmark = pytest.mark.integration

#: The daemon's limit on open descriptors (soft and hard): its guard acts past 1,024,
#: and the rest is room for the flood while the guard is kept off the CPU.
LIMIT = 8192
MAX_CONNECTIONS = 64
#: Sets the limit, then runs the daemon's command line in its place.
LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


@pytest.fixture
def limited_daemon(identity_model: Path) -> Iterator[DaemonProcess]:
    """A daemon serving ``identity`` under ``LIMIT`` descriptors; this test
    process may hold ``LIMIT`` raw connections besides its own descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = LIMIT + 1024
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(
            f"the flood needs {needed} descriptors in this process; the hard limit is {hard}"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    text = render_config(
        workdir,
        [{"name": "identity", "path": str(identity_model)}],
        bus={"max_connections": MAX_CONNECTIONS},
        daemon={"log_level": "info"},
    )
    try:
        daemon = start_daemon(text, workdir, launcher=[sys.executable, "-c", LIMITED, str(LIMIT)])
        yield daemon
        if daemon.process.poll() is None:
            daemon.stop()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        shutil.rmtree(workdir, ignore_errors=True)


def ended_by_the_daemon(sock: socket.socket) -> bool:
    """Whether the daemon shut ``sock``'s connection down (it reads its end)."""
    sock.setblocking(False)
    try:
        while sock.recv(4096):  # libzmq's greeting, then the end
            pass
    except BlockingIOError:
        return False  # open
    return True


def test_a_flood_that_never_greets_is_ended_and_the_daemon_serves_on(
    limited_daemon: DaemonProcess,
) -> None:
    daemon = limited_daemon
    x = {"input": np.ones(IDENTITY_SHAPE, np.float32)}
    path = daemon.infer[len("ipc://") :]

    def security() -> dict[str, Any]:
        with OperatorClient(daemon.control, timeout=5) as operator:
            return dict(operator.status()["security"])

    # Connected before the flood, among this user's first MAX_CONNECTIONS
    # connections to the socket (the daemon held ~40 descriptors): it keeps it.
    with InferenceClient(daemon.infer, timeout=10) as client:
        assert client.infer("identity", x)["output"].shape == IDENTITY_SHAPE
        held: collections.deque[socket.socket] = collections.deque()
        try:
            for count in range(LIMIT + LIMIT // 4):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(path)
                except OSError as exc:
                    sock.close()
                    code = daemon.process.wait(HANG_S)  # -6: libzmq's abort on EMFILE
                    pytest.fail(f"connection {count}: {exc}; the daemon exited with {code}")
                held.append(sock)
                if len(held) == LIMIT:  # as many as the daemon may hold: recycle the oldest
                    held.popleft().close()
                if count == LIMIT + LIMIT // 8:  # served during the flood
                    assert client.infer("identity", x)["output"].shape == IDENTITY_SHAPE
            assert daemon.process.poll() is None
            assert client.infer("identity", x)["output"].shape == IDENTITY_SHAPE
            ended = sum(ended_by_the_daemon(sock) for sock in held)
            assert ended > 0

            def counted() -> dict[str, Any] | None:
                """The guard's status once it counted the ends the clients read (each
                is the guard's, counted once its pass is over)."""
                guard = security()["descriptor_guard"]
                return guard if guard["connections_ended"] >= ended else None

            guard = wait_until(counted, message=f"{ended} ended connections counted")
            assert (guard["limit"], guard["threshold"], guard["episodes"]) == (LIMIT, LIMIT // 8, 1)
        finally:
            for sock in held:
                sock.close()
        # Once the flood's connections are gone, a new client of the same user gets in.
        wait_until(lambda: security()["sockets"]["infer"]["connections"] == 1)
        with InferenceClient(daemon.infer, timeout=10) as newcomer:
            assert newcomer.infer("identity", x)["output"].shape == IDENTITY_SHAPE
    log = daemon.log()
    assert log.count("descriptor_flood_trimmed") == 1, "once per flood"
    assert f"max_connections={MAX_CONNECTIONS}" in log
