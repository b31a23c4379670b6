"""``build.start`` cannot fill the disk: it is rate limited per peer and the builds
dir stays within ``builds.max_count``/``max_bytes``, each removal an FDR record;
the cap is kept from what is on disk, so it holds across a restart
(simulated builds, the daemon's fast builder where TensorRT is missing)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd.fdr.reader import ReadReport, read_records
from inferd_client import OperatorClient, RemoteError
from tests.conftest import HANG_S, DaemonProcess, Events, render_config, start_daemon
from tests.integration.test_schemas import assert_valid

pytestmark = pytest.mark.integration

REQUESTS = 32
#: Each build is a child process (about a second): a burst of 4 under a cap of 2
#: prunes twice, the oldest first, and keeps the newest 2.
BURST = 4
MAX_COUNT = 2
TERMINAL = ("completed", "failed", "cancelled")


def engines(build_dir: Path) -> list[str]:
    """Build ids of the engines in the builds dir, oldest first (read from the disk,
    not from the daemon)."""
    found = sorted(build_dir.glob("*/*.simulated.engine"), key=lambda p: p.stat().st_mtime_ns)
    return [path.name.split(".")[1] for path in found]


def removals(daemon: DaemonProcess) -> list[dict[str, Any]]:
    directory = daemon.workdir / "state" / "fdr"
    kinds = ["build_artifact_removed"]
    return [record.payload for record in read_records(directory, ReadReport(), kinds=kinds)]


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ifd-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(workdir: Path, demo_model: Path, **builds: Any) -> DaemonProcess:
    text = render_config(workdir, [{"name": "demo", "path": str(demo_model)}], builds=builds)
    return start_daemon(text, workdir)


def test_build_start_in_a_row_is_rate_limited_and_the_builds_dir_capped(
    workdir: Path, demo_model: Path
) -> None:
    daemon = start(
        workdir, demo_model, max_count=MAX_COUNT, start_burst=BURST, start_refill_s=3600.0
    )
    build_dir = workdir / "state" / "builds"
    started: list[str] = []
    refused: list[str] = []
    try:
        with (
            Events(daemon.events, topics=["build"]) as events,
            OperatorClient(daemon.control) as operator,
        ):
            for _ in range(REQUESTS):
                try:
                    reply = operator.call(
                        "build.start", model="demo", builder="simulated", simulation={"step_s": 0}
                    )
                except RemoteError as exc:
                    assert exc.code == "RESOURCE_EXHAUSTED", exc
                    refused.append(exc.message)
                    continue
                build_id = reply["build_id"]
                started.append(build_id)
                events.next(
                    lambda _t, e, b=build_id: e["buildId"] == b and e["type"] in TERMINAL,
                    f"the end of build {build_id}",
                )
                # The daemon pruned before it published the end of the build.
                assert len(engines(build_dir)) <= MAX_COUNT
            listing = operator.call("build.status")
        assert_valid(
            "build_status_reply.json#/$defs/ok", {"v": 1, "id": 1, "ok": True, "result": listing}
        )
    finally:
        daemon.stop()
    assert len(started) == BURST and len(refused) == REQUESTS - BURST
    assert all("rate limit for uid" in m and "retry after" in m for m in refused), refused[0]
    assert listing["start_limit"]["refused"] == REQUESTS - BURST
    assert listing["retention"]["count"] == MAX_COUNT
    kept = engines(build_dir)
    assert kept == started[-MAX_COUNT:]  # the oldest went first
    records = removals(daemon)
    assert [r["build_id"] for r in records] == started[: BURST - MAX_COUNT]
    for record in records:
        assert record["reason"] == "max_count" and record["trigger"].endswith("finished")
        assert not any(Path(name).exists() for name in record["files"])
        assert record["bytes"] > 0


def test_the_cap_holds_across_a_restart(workdir: Path, demo_model: Path) -> None:
    daemon = start(workdir, demo_model, max_count=MAX_COUNT, start_burst=MAX_COUNT)
    try:
        with (
            Events(daemon.events, topics=["build"]) as events,
            OperatorClient(daemon.control) as operator,
        ):
            for _ in range(MAX_COUNT):
                build_id = operator.call("build.start", model="demo", builder="simulated")[
                    "build_id"
                ]
                events.next(
                    lambda _t, e, b=build_id: e["buildId"] == b and e["type"] in TERMINAL,
                    "the end of the build",
                    timeout=HANG_S,
                )
    finally:
        daemon.stop()
    build_dir = workdir / "state" / "builds"
    before = engines(build_dir)
    assert len(before) == MAX_COUNT and removals(daemon) == []
    # A new daemon with a smaller cap finds them on disk and prunes at start.
    daemon = start(workdir, demo_model, max_count=1)
    daemon.stop()
    assert engines(build_dir) == before[-1:]
    records = removals(daemon)
    assert [(r["build_id"], r["trigger"]) for r in records] == [
        (build_id, "daemon_start") for build_id in before[:-1]
    ]
