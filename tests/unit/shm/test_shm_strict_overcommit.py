"""Under the kernel's strict overcommit (``vm.overcommit_memory`` = 2) the daemon
serves no ``shm.sock``: a memfd's pages are charged to the system's commit when
the daemon first touches them, a refused charge is a SIGBUS (``mm/shmem.c``:
``shmem_acct_blocks``' failure is reported as ``-ENOSPC``), and any client could
bring the commit to its limit and then name a sparse or hole-punched region in a
request.  The sysctl is read from a file the test names; no sysctl is changed."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd import config as config_module
from inferd.config import ShmConfig
from inferd.daemon import Daemon
from inferd.shm.memfd import strict_overcommit
from inferd.shm.server import ShmServer
from inferd_client import cli_format, top
from inferd_wire import protocol
from tests.conftest import render_config
from tests.integration.test_schemas import assert_valid


def policy_file(directory: Path, policy: str) -> Path:
    path = directory / "overcommit_memory"
    path.write_text(policy)
    return path


def test_only_the_strict_policy_is_refused(tmp_path: Path) -> None:
    assert strict_overcommit(policy_file(tmp_path, "0\n")) is None  # heuristic, the default
    assert strict_overcommit(policy_file(tmp_path, "1\n")) is None  # always
    reason = strict_overcommit(policy_file(tmp_path, "2\n"))
    assert reason is not None and "vm.overcommit_memory = 2" in reason
    assert "SIGBUS" in reason and "set vm.overcommit_memory to 0 or 1" in reason


@pytest.fixture
def served(short_tmp_path: Path) -> Iterator[tuple[ShmServer, Path]]:
    """An ``ShmServer`` reading the policy from a file of the test's (``2`` unless
    the test writes another first), and its socket's path."""
    path = short_tmp_path / "shm.sock"
    policy = policy_file(short_tmp_path, "2\n")
    server = ShmServer(ShmConfig(socket=path), overcommit_memory=policy)
    yield server, policy
    server.stop()
    assert not server.is_alive() and not server.closer.is_alive()
    assert not path.exists()


def test_under_strict_overcommit_no_socket_is_bound_and_status_says_why(
    served: tuple[ShmServer, Path],
) -> None:
    server, _ = served
    with capture_logs() as logs:
        server.start()
    [refused] = [entry for entry in logs if entry["event"] == "shm_refused_strict_overcommit"]
    assert refused["log_level"] == "error" and "vm.overcommit_memory = 2" in refused["reason"]
    assert server.ident is None and not server.closer.is_alive()  # no thread started
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with client, pytest.raises(FileNotFoundError):
        client.connect(str(server._config.socket))  # nothing a client could reach
    assert server.status() == {"enabled": False, "reason": refused["reason"]}


@pytest.mark.parametrize("policy", ["0\n", "1\n"])
def test_under_the_other_policies_the_socket_is_served(
    served: tuple[ShmServer, Path], policy: str
) -> None:
    server, path = served
    path.write_text(policy)
    server.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with client:
        client.connect(str(server._config.socket))
    assert server.status()["enabled"] is True and server.refused is None


def test_a_policy_that_cannot_be_read_is_said_and_the_socket_served(
    served: tuple[ShmServer, Path],
) -> None:
    server, path = served
    path.unlink()  # no /proc/sys in a sandbox
    with capture_logs() as logs:
        server.start()
    [unknown] = [entry for entry in logs if entry["event"] == "shm_overcommit_unknown"]
    assert unknown["log_level"] == "warning" and unknown["path"] == str(path)
    assert server.status()["enabled"] is True


def test_the_daemons_status_and_inferctl_say_shm_is_off_and_why(tmp_path: Path) -> None:
    model: dict[str, object] = {"name": "demo", "path": str(tmp_path / "never-loaded.onnx")}
    (tmp_path / "inferd.toml").write_text(render_config(tmp_path, [model]))
    daemon = Daemon(config_module.load(tmp_path / "inferd.toml"))
    try:
        assert daemon.shm is not None
        daemon.shm.stop()  # the one it made, never started: replaced by one reading a file
        daemon.shm = ShmServer(daemon.config.shm, overcommit_memory=policy_file(tmp_path, "2\n"))
        daemon.shm.start()
        status = daemon.status({})
        assert status["shm"]["enabled"] is False
        reason = status["shm"]["reason"]
        assert_valid("status_reply.json#/$defs/ok", protocol.ok_header(1, result=status))
        assert f"shm: off ({reason})" in cli_format.status(status)
        assert reason in top._shm(status["shm"]).plain
    finally:
        daemon.stop()
