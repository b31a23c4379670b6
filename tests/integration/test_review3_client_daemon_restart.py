"""``inferctl build follow ID`` and ``inferctl events`` across a daemon killed
(SIGKILL) and started again on the same config (third review of the Python
client, finding 1).

The subscriber connects again by itself and the new daemon's health events keep
a follow alive: ``build follow`` of a build the new daemon does not know went on
for good (SIGINT then ended it with 0, so ``build follow ID && inferctl switch``
went on), and ``events`` showed no sign of the events it missed.  Now the first
says the build is gone (exit 1) and the second says events were missed."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from inferd_client import OperatorClient
from tests.conftest import REPO, DaemonProcess, render_config, start_daemon, stop_daemons

pytestmark = pytest.mark.integration

#: Bounds a follower that would not end (the old hang); far above the ~2 s a
#: restart takes here.
BOUND_S = 10.0
#: inferctl's --timeout: a follow gone silent this long ends (exit 3); the restart
#: must not look like that.
CLI_TIMEOUT_S = 8


@pytest.fixture
def restartable(demo_model: Path) -> Iterator[tuple[DaemonProcess, Callable[[], None]]]:
    """A daemon, and ``restart()``: SIGKILL it and start it again on the same config
    and directory (its sockets on the same paths); both stopped after the test."""
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))  # short: ipc paths max 107 bytes
    text = render_config(workdir, [{"name": "demo", "path": str(demo_model)}])
    daemons = [start_daemon(text, workdir)]

    def restart() -> None:
        daemons[-1].stop(signal.SIGKILL)
        daemons.append(start_daemon(text, workdir))

    yield daemons[0], restart
    stop_daemons(daemons)
    shutil.rmtree(workdir, ignore_errors=True)


def inferctl(daemon: DaemonProcess, *args: str) -> subprocess.Popen[str]:
    """``inferctl --timeout CLI_TIMEOUT_S ARGS`` on the daemon's sockets, running."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferd_client.cli",
            "--timeout",
            str(CLI_TIMEOUT_S),
            "--control-endpoint",
            daemon.control,
            "--events-endpoint",
            daemon.events,
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def test_build_follow_of_a_build_the_restarted_daemon_lost_exits_1_saying_so(
    restartable: tuple[DaemonProcess, Callable[[], None]],
) -> None:
    daemon, restart = restartable
    with OperatorClient(daemon.control, timeout=5) as operator:
        # Slow steps: the build is still running when the daemon is killed.
        started = operator.call(
            "build.start", model="demo", builder="simulated", simulation={"step_s": 0.5}
        )
    build_id = str(started["build_id"])
    follow = inferctl(daemon, "build", "follow", build_id)
    watchdog = threading.Timer(BOUND_S + 20, follow.kill)  # a hang fails, never blocks
    watchdog.start()
    try:
        assert follow.stdout is not None and follow.stderr is not None
        assert follow.stderr.readline() == "following build events\n"
        # Its state, read after the join: the follow is under way.
        assert follow.stdout.readline().startswith(f"build {build_id} ")
        restart()
        try:
            out, err = follow.communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            follow.send_signal(signal.SIGINT)
            out, err = follow.communicate(timeout=BOUND_S)
            pytest.fail(
                f"build follow still ran {BOUND_S} s after the restart "
                f"(SIGINT: exit {follow.returncode}); stderr {err!r}"
            )
    finally:
        watchdog.cancel()
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 1, (out[-500:], err)
    assert "lost and made again" in err and f"asking build.status of {build_id} again" in err
    assert f"NOT_FOUND: build {build_id} is gone" in err and "restarted" in err


def test_events_says_once_that_events_were_missed_across_a_restart(
    restartable: tuple[DaemonProcess, Callable[[], None]],
) -> None:
    daemon, restart = restartable
    events = inferctl(daemon, "events", "--topic", "health", "--json")
    watchdog = threading.Timer(BOUND_S + 20, events.kill)  # a hang fails, never blocks
    watchdog.start()
    try:
        assert events.stdout is not None and events.stderr is not None
        assert events.stderr.readline() == "following events (health)\n"
        assert events.stdout.readline().startswith("{")  # a health event: under way
        restart()
        # Before: nothing more ever came on stderr (the watchdog's kill ends the read).
        found = threading.Event()
        said: list[str] = []

        def read_stderr() -> None:
            assert events.stderr is not None
            said.append(events.stderr.readline())
            found.set()

        threading.Thread(target=read_stderr, daemon=True).start()
        assert found.wait(BOUND_S), f"no word on stderr {BOUND_S} s after the restart"
        assert said[0].startswith("inferctl: the connection to the daemon's events was lost")
        assert "events published meanwhile were missed" in said[0]
        # And it goes on with the new daemon's events.
        assert events.stdout.readline().startswith("{")
        events.send_signal(signal.SIGINT)
        _out, err = events.communicate(timeout=BOUND_S)
    finally:
        watchdog.cancel()
        if events.poll() is None:
            events.kill()
            events.wait()
    assert events.returncode == 0, err
    assert "lost" not in err  # said once
