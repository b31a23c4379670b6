"""``inferctl build follow`` exits 1 for a build that ended ``failed`` as for one
``cancelled`` (DESIGN.md 177): ``inferctl build follow ID && inferctl switch ...``
must stop at a build that produced no engine, whether the follow saw it fail or
found it failed already.  ``simulation.fail`` makes the simulated build fail."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import HANG_S, DaemonFactory, wait_until
from tests.integration.test_daemon_builds import build_status, control, follow_builds, inferctl

pytestmark = pytest.mark.integration


def test_build_follow_exits_1_for_a_failed_build_seen_live_and_ended(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    follow = follow_builds(daemon)
    watchdog = threading.Timer(HANG_S, follow.kill)  # a follower that hangs fails
    watchdog.start()
    try:
        assert follow.stdout is not None and follow.stderr is not None
        assert follow.stderr.readline() == "following build events\n"  # subscribed
        reply = control(
            daemon,
            "build.start",
            model="demo",
            builder="simulated",
            simulation={"fail": "the simulated builder fails (test)"},
        )
        build_id = str(reply["result"]["build_id"])
        lines = follow.stdout.read().splitlines()
        follow.wait(timeout=HANG_S)
    finally:
        watchdog.cancel()
        if follow.poll() is None:
            follow.kill()
    # With the build's timing-cache decision, named once (DESIGN.md 274).
    assert lines and lines[-1].startswith(
        f"FAILED build {build_id} [simulated] timing cache: discarded {{"
    ), lines[-1:]
    assert "timingCacheMode" not in lines[-1]
    assert follow.returncode == 1, "a follow that saw its build fail exited 0"

    wait_until(lambda: build_status(daemon, build_id)["state"] == "failed", message="failed")
    ended = inferctl(daemon, "build", "follow", build_id, "--json")
    assert ended.returncode == 1, (ended.stdout, ended.stderr)
