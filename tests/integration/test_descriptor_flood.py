"""Floods of raw connections that never send their ZeroMQ greeting, against a
real daemon with a low limit on open descriptors (DESIGN.md 128).

Such a connection never reaches the ZAP handler, so ``bus.max_connections`` does
not bound it; without the descriptor guard libzmq's ``ipc://`` listener aborts the
daemon (SIGABRT) once an accept finds no descriptor left (about 8,150 connections,
0.4 s here, at a limit of 8,192).  From one user the guard ends what it holds past
the bound; from many users together, each within it, what they hold past a fair
share (as root: forked children as other uids, in the socket's group)."""

from __future__ import annotations

import collections
import json
import os
import resource
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd_client import InferenceClient, OperatorClient
from tests.conftest import (
    HANG_S,
    DaemonProcess,
    poll,
    render_config,
    start_daemon,
    wait_until,
)
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


#: The flood of many users: USERS uids, each holding up to SHARED_MAX_CONNECTIONS
#: to infer.sock (5,120 in all, within the bound each) against a limit of 4,096.
USERS = 20
SHARED_LIMIT = 4096
SHARED_MAX_CONNECTIONS = 256
#: The infer socket's group (``security.infer_group``, docs/SECURITY.md) and the
#: flooding users: numbers only, no account needed.
FLOOD_GID = 64_500
FLOOD_UIDS = range(FLOOD_GID + 1, FLOOD_GID + 1 + USERS)


@contextmanager
def _limited(
    identity_model: Path,
    limit: int,
    max_connections: int,
    prepare: Callable[[Path], dict[str, Any]] = lambda workdir: {},
) -> Iterator[DaemonProcess]:
    """A daemon serving ``identity`` under ``limit`` descriptors; this test process
    may hold ``limit`` raw connections besides its own descriptors.  ``prepare``
    readies the work dir and gives the config's other sections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = limit + 1024
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(
            f"the flood needs {needed} descriptors in this process; the hard limit is {hard}"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    try:
        text = render_config(
            workdir,
            [{"name": "identity", "path": str(identity_model)}],
            bus={"max_connections": max_connections},
            daemon={"log_level": "info"},
            **prepare(workdir),
        )
        daemon = start_daemon(text, workdir, launcher=[sys.executable, "-c", LIMITED, str(limit)])
        yield daemon
        if daemon.process.poll() is None:
            daemon.stop()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def limited_daemon(identity_model: Path) -> Iterator[DaemonProcess]:
    with _limited(identity_model, LIMIT, MAX_CONNECTIONS) as daemon:
        yield daemon


def _shared_with_the_flood_group(workdir: Path) -> dict[str, Any]:
    """As docs/SECURITY.md sets up clients: the runtime dir and the infer socket in
    their group (``security.infer_group``), the work dir passable; no ``shm.sock``,
    whose room the daemon would need under the limit besides."""
    workdir.chmod(0o711)
    (workdir / "run").mkdir(mode=0o750)
    os.chown(workdir / "run", 0, FLOOD_GID)  # like systemd's RuntimeDirectory
    return {"security": {"infer_group": str(FLOOD_GID)}, "shm": {"enabled": False}}


@pytest.fixture
def shared_limited_daemon(identity_model: Path) -> Iterator[DaemonProcess]:
    """A daemon under ``SHARED_LIMIT`` descriptors whose infer socket the flooding
    users may open."""
    if os.geteuid() != 0:
        pytest.skip("running clients as other users needs root (CI runs as root)")
    with _limited(
        identity_model, SHARED_LIMIT, SHARED_MAX_CONNECTIONS, _shared_with_the_flood_group
    ) as daemon:
        yield daemon


def ended_by_the_daemon(sock: socket.socket) -> bool:
    """Whether the daemon shut ``sock``'s connection down (it reads its end)."""
    sock.setblocking(False)
    try:
        while sock.recv(4096):  # libzmq's greeting, then the end
            pass
    except BlockingIOError:
        return False  # open
    return True


def security_of(daemon: DaemonProcess) -> dict[str, Any]:
    """The daemon's ``status.security``, asked on a connection of its own."""
    with OperatorClient(daemon.control, timeout=5) as operator:
        return dict(operator.status()["security"])


def test_a_flood_that_never_greets_is_ended_and_the_daemon_serves_on(
    limited_daemon: DaemonProcess,
) -> None:
    daemon = limited_daemon
    x = {"input": np.ones(IDENTITY_SHAPE, np.float32)}
    path = daemon.infer[len("ipc://") :]

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
                guard = security_of(daemon)["descriptor_guard"]
                return guard if guard["connections_ended"] >= ended else None

            guard = wait_until(counted, message=f"{ended} ended connections counted")
            assert (guard["limit"], guard["threshold"], guard["episodes"]) == (LIMIT, LIMIT // 8, 1)
        finally:
            for sock in held:
                sock.close()
        # Once the flood's connections are gone, a new client of the same user gets in.
        wait_until(lambda: security_of(daemon)["sockets"]["infer"]["connections"] == 1)
        with InferenceClient(daemon.infer, timeout=10) as newcomer:
            assert newcomer.infer("identity", x)["output"].shape == IDENTITY_SHAPE
    log = daemon.log()
    assert log.count("descriptor_flood_trimmed") == 1, "once per flood"
    assert f"max_connections={MAX_CONNECTIONS}" in log


def _flood_as(uid: int, path: str, start: int, hold: int, report: int) -> None:
    """A forked child: become ``uid`` in the flood's group, wait for ``start`` to
    read its end, open up to ``SHARED_MAX_CONNECTIONS`` raw connections to ``path``
    that never greet, report how many, hold them until ``hold`` reads its end, then
    report how many the daemon ended; never returns into pytest."""
    result: dict[str, Any] = {"uid": uid}
    try:
        os.setgroups([FLOOD_GID])
        os.setresgid(FLOOD_GID, FLOOD_GID, FLOOD_GID)
        os.setresuid(uid, uid, uid)
        os.read(start, 1)
        held: list[socket.socket] = []
        try:
            for _ in range(SHARED_MAX_CONNECTIONS):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                held.append(sock)
                sock.connect(path)
        except OSError as exc:
            result["error"] = f"connection {len(held)}: {exc}"
        os.write(report, (json.dumps({**result, "opened": len(held)}) + "\n").encode())
        os.read(hold, 1)
        result["ended"] = sum(ended_by_the_daemon(sock) for sock in held)
        result["opened"] = len(held)
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    os.write(report, (json.dumps(result) + "\n").encode())
    os._exit(0)


def test_a_flood_of_many_users_within_the_bound_is_held_to_fair_shares(
    shared_limited_daemon: DaemonProcess,
) -> None:
    """20 users each open 256 connections that never greet (5,120, each user
    within ``max_connections``) against a limit of 4,096: past a quarter of it the
    guard holds them to a fair share of 768 in all (one user's bound on the three
    sockets, above the threshold, 512); the daemon
    survives (without the second stage it aborts, -6), a client connected before
    keeps its connection and is served, a newcomer is served during the flood, and
    each user keeps at least its share."""
    daemon = shared_limited_daemon
    x = {"input": np.ones(IDENTITY_SHAPE, np.float32)}
    path = daemon.infer[len("ipc://") :]

    with InferenceClient(daemon.infer, timeout=10) as client:
        assert client.infer("identity", x)["output"].shape == IDENTITY_SHAPE
        accepted = security_of(daemon)["sockets"]["infer"]["connections_accepted"]
        start_read, start_write = os.pipe()
        hold_read, hold_write = os.pipe()
        report_read, report_write = os.pipe()
        children = []
        for uid in FLOOD_UIDS:
            pid = os.fork()
            if pid == 0:  # the parent's ends: each child must read the end of the pipes
                for fd in (start_write, hold_write, report_read):
                    os.close(fd)
                _flood_as(uid, path, start_read, hold_read, report_write)
            children.append(pid)
        os.close(report_write)
        reports = os.fdopen(report_read)
        try:
            os.close(start_write)  # all flood together
            opened = [json.loads(reports.readline()) for _ in children]
            errors = [report["error"] for report in opened if "error" in report]
            if errors:  # the daemon's end (-6: libzmq's abort on EMFILE) or a bug here
                code = poll(daemon.process.poll, lambda code: code is not None, 2.0)
                pytest.fail(f"{errors[0]} ({len(errors)} users); the daemon's exit: {code}")

            def guard_shared() -> dict[str, Any] | None:
                if daemon.process.poll() is not None:
                    pytest.fail(f"the daemon exited with {daemon.process.returncode}: {opened}")
                guard = security_of(daemon)["descriptor_guard"]
                return guard if guard["connections_ended_past_share"] else None

            guard = wait_until(guard_shared, message="connections ended past a fair share")
            assert (guard["share_level"], guard["share_target"]) == (1024, 768)
            # The client connected before is served on the connection it had.
            assert client.infer("identity", x)["output"].shape == IDENTITY_SHAPE
            assert security_of(daemon)["sockets"]["infer"]["connections_accepted"] == accepted
            with InferenceClient(daemon.infer, timeout=10) as newcomer:
                assert newcomer.infer("identity", x)["output"].shape == IDENTITY_SHAPE
        finally:
            os.close(hold_write)
            results = [json.loads(line) for line in reports]
            reports.close()
            for pid in children:
                os.waitpid(pid, 0)
            for fd in (start_read, hold_read):
                os.close(fd)
    assert not [result for result in results if "error" in result]
    assert sorted(result["uid"] for result in results) == list(FLOOD_UIDS)
    # Each user keeps at least the share: 768 among the flood's 20 users and this
    # process's connections to the infer and control sockets (a user whose
    # connections all came after the passes may keep them all).
    share = (3 * SHARED_MAX_CONNECTIONS) // (USERS + 2)
    assert all(r["opened"] - r["ended"] >= share for r in results), results
    ended = sum(result["ended"] for result in results)
    assert ended >= USERS * SHARED_MAX_CONNECTIONS - SHARED_LIMIT
    wait_until(
        lambda: security_of(daemon)["descriptor_guard"]["connections_ended"] >= ended,
        message=f"{ended} ended connections counted",
    )
    assert daemon.process.poll() is None
    assert daemon.log().count("descriptor_flood_shared") == 1
