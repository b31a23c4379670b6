"""The daemon's own directories against another local user (issue "security and
resource limits", points 1, 9, 10), with a real second user where the suite runs as
root: a runtime or state dir someone else owns or may write is refused before
anything is written; a symlink planted where the daemon writes is never followed;
a client will not talk to a socket in the fallback runtime dir another user made;
a daemon cannot take over another daemon's socket directory; what the daemon
writes is not world-readable."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from inferd_client import OperatorClient
from tests.conftest import REPO, DaemonFactory, OtherUser, render_config, wait_until

pytestmark = pytest.mark.integration


def run_daemon_expecting_refusal(config_text: str, workdir: Path, exit_status: int) -> str:
    """Start ``inferd run`` that must refuse to start with ``exit_status`` (2: an unsafe
    directory, which a restart would meet again; 1: what a restart may not); its stderr."""
    config = workdir / "inferd.toml"
    config.write_text(config_text)
    done = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == exit_status, done.stderr
    assert "cannot start" in done.stderr
    return done.stderr


def test_a_runtime_dir_another_user_owns_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path, demo_model: Path, other_user: OtherUser
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "inferd.lock").symlink_to(victim)  # what the other user planted
    os.lchown(run_dir / "inferd.lock", other_user.uid, other_user.gid)
    os.chown(run_dir, other_user.uid, other_user.gid)
    stderr = run_daemon_expecting_refusal(
        render_config(tmp_path, [{"name": "demo", "path": str(demo_model)}]), tmp_path, 2
    )
    assert f"daemon.runtime_dir {run_dir} is owned by uid {other_user.uid}" in stderr
    assert victim.read_text() == "root's file\n"


def test_a_lock_file_planted_as_a_symlink_in_its_own_dir_is_not_followed(
    tmp_path: Path, demo_model: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "inferd.lock").symlink_to(victim)
    # In a directory that is safely the daemon's: refused by name, exit 2 (a restart
    # meets the same symlink), as for an unsafe directory.
    stderr = run_daemon_expecting_refusal(
        render_config(tmp_path, [{"name": "demo", "path": str(demo_model)}]), tmp_path, 2
    )
    assert f"{run_dir / 'inferd.lock'} is a symbolic link, not a regular file" in stderr
    assert victim.read_text() == "keep\n"


def test_a_state_dir_others_may_write_is_refused(tmp_path: Path, demo_model: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    stderr = run_daemon_expecting_refusal(
        render_config(tmp_path, [{"name": "demo", "path": str(demo_model)}]), tmp_path, 2
    )
    assert f"daemon.state_dir {state} is writable by its group and others" in stderr


def test_a_client_will_not_read_a_socket_in_a_fallback_dir_another_user_made(
    tmp_path: Path, other_user: OtherUser
) -> None:
    fallback = tmp_path / f"inferd-{os.getuid()}"
    fallback.mkdir(mode=0o755)
    os.chown(fallback, other_user.uid, other_user.gid)
    context = zmq.Context()
    forger = context.socket(zmq.ROUTER)
    forger.bind(f"ipc://{fallback}/control.sock")  # would answer with a forged health
    try:
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("XDG_RUNTIME_DIR", "INFERD_RUNTIME_DIR", "RUNTIME_DIRECTORY")
        }
        env["TMPDIR"] = str(tmp_path)
        done = subprocess.run(
            [sys.executable, "-m", "inferd_client.cli", "--timeout", "2", "health"],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=60,
        )
        assert done.returncode == 3, done.stdout + done.stderr
        assert f"is owned by uid {other_user.uid}, not by uid {os.getuid()}" in done.stderr
        assert forger.poll(0) == 0  # the client never sent it a thing
    finally:
        forger.close(linger=0)
        context.term()


def test_a_second_daemon_cannot_take_over_another_daemons_socket_dir(
    daemon_factory: DaemonFactory, tmp_path: Path, demo_model: Path
) -> None:
    first = daemon_factory()
    # Its own runtime dir, but its control socket in the first daemon's.
    second = render_config(
        tmp_path,
        [{"name": "demo", "path": str(demo_model)}],
        bus={"control_endpoint": first.control},
    )
    stderr = run_daemon_expecting_refusal(second, tmp_path, 1)  # the lock: it may be let go
    assert f"another inferd holds {first.workdir / 'run' / 'inferd.lock'}" in stderr
    with OperatorClient(first.control) as operator:  # still the first daemon's socket
        assert operator.status()["daemon"]["pid"] == first.process.pid


def test_nothing_the_daemon_writes_is_world_readable(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    state = daemon.workdir / "state"
    wait_until(lambda: any((state / "fdr").glob("*")), 10, message="an FDR segment")
    written = [path for path in state.rglob("*")] + [daemon.workdir / "run" / "inferd.lock"]
    assert written
    readable = {
        str(path): oct(path.stat().st_mode) for path in written if path.stat().st_mode & 0o007
    }
    assert readable == {}
    assert not stat.S_IMODE(state.stat().st_mode) & 0o027
