"""What ``inferctl`` promises a person and a script (issue "install, CLI, metrics",
part 2): ``--version``; a missing socket fails at once and says where it looked;
the following commands (``events``, ``thermal --follow``, ``build follow``) never
hang when the daemon is down or goes away; ``health`` is a probe (exit 4 when not
serving); ``| head`` ends quietly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import inferd_wire
from tests.conftest import REPO, DaemonFactory, run_inferctl

pytestmark = pytest.mark.integration


def endpoints(daemon_workdir: Path) -> list[str]:
    run = daemon_workdir / "run"
    return [
        "--infer-endpoint",
        f"ipc://{run}/infer.sock",
        "--control-endpoint",
        f"ipc://{run}/control.sock",
        "--events-endpoint",
        f"ipc://{run}/events.sock",
    ]


def test_version_is_the_one_version() -> None:
    result = run_inferctl("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"inferctl {inferd_wire.__version__}")


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["events"],
        ["thermal", "--follow"],
        ["build", "follow"],
        ["infer", "--model", "demo", "--random"],
    ],
)
def test_no_socket_fails_at_once_and_says_where_it_looked(
    tmp_path: Path, command: list[str]
) -> None:
    env = {**os.environ, "INFERD_RUNTIME_DIR": str(tmp_path / "nowhere")}
    started = time.monotonic()
    result = run_inferctl("--timeout", "30", *command, env=env)
    assert time.monotonic() - started < 15  # well under --timeout: it never waited
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"no daemon socket at {tmp_path / 'nowhere'}/" in result.stderr
    assert "$INFERD_RUNTIME_DIR" in result.stderr and "INFERD_RUNTIME_DIR=DIR" in result.stderr


@pytest.mark.parametrize("command", [["events"], ["thermal", "--follow"], ["build", "follow"]])
def test_following_ends_when_the_daemon_goes_away(
    daemon_factory: DaemonFactory, command: list[str]
) -> None:
    # --timeout bounds the join (the first health event) and then the silence that
    # ends the follower: 10 health intervals here, waited out once the daemon stopped.
    daemon = daemon_factory(daemon={"health_interval_s": 0.1})
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferd_client.cli",
            "--timeout",
            "1",
            *endpoints(daemon.workdir),
            *command,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert follower.stdout is not None and follower.stderr is not None
        # Joined: it says so once the daemon's first health event came.
        assert follower.stderr.readline().startswith("following ")
        if command == ["events"]:
            # A thermal event published before the joining health event is printed
            # first (``wait_joined`` keeps it): the health line is among the first.
            first = [follower.stdout.readline() for _ in range(3)]
            assert any("health" in line for line in first), first
        assert daemon.stop() == 0
        code = follower.wait(timeout=30)  # bounded by --timeout after the last event
    finally:
        if follower.poll() is None:
            follower.kill()
    assert code == 3
    assert follower.stderr is not None and "nothing from" in follower.stderr.read()


def test_events_on_a_prefix_of_health_prints_health_and_ends(
    daemon_factory: DaemonFactory,
) -> None:
    """``--topic he`` asks for health events: they are printed, not hidden as those
    used only to join (hidden, they kept ``--count 2`` from ever being reached)."""
    daemon = daemon_factory()
    command = ["--timeout", "5", "events", "--topic", "he", "--count", "2"]
    result = run_inferctl(*endpoints(daemon.workdir), *command, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("health") == 2, result.stdout


def test_health_is_a_probe(daemon_factory: DaemonFactory, demo_model: Path) -> None:
    serving = daemon_factory()
    assert run_inferctl(*endpoints(serving.workdir), "health").returncode == 0
    degraded = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "tensorrt"}]
    )  # no TensorRT here: it serves on the fallback, degraded
    result = run_inferctl(*endpoints(degraded.workdir), "health")
    assert result.returncode == 4, result.stdout + result.stderr
    assert "degraded" in result.stdout


def test_a_closed_pipe_ends_quietly(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    reader = subprocess.Popen(
        [sys.executable, "-m", "inferd_client.cli", *endpoints(daemon.workdir), "events"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert reader.stdout is not None and reader.stderr is not None
    # like `| head -1`: whichever event came first (health, or the thermal state)
    assert reader.stdout.readline().split()[1] in (b"health", b"thermal")
    reader.stdout.close()
    assert reader.wait(timeout=30) == 0
    assert reader.stderr.read() == b"following events (all)\n"  # no BrokenPipeError traceback
