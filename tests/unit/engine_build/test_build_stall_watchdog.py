"""The daemon's builds run the stall watchdog (``builds.stall_after_s``,
``builds.stall_cancels_after``, ``build.start``'s ``stall_after_s``).

Before, only ``inferd build --stall-after`` ran it: a daemon build's child (build.start,
the daemon's own rebuilds) was given no watchdog, its ``phase_tree.stalls`` was always
0 and a wedged TensorRT tactic phase ended, silently, at ``builds.max_duration_s`` (4 h).
Two real build children (simulated, each step slower than the watchdog's period, so
the child goes silent between steps) under a real ``BuildManager``; the rest in process.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import structlog

from inferd.config import BuildsConfig, ModelConfig
from inferd.engine_build import child, child_process
from inferd.engine_build.build_args import parse_start
from inferd.engine_build.build_record import Build, describe, said_stalled
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.events import BuildEvent
from inferd.engine_build.progress import ProgressAdapter, StallWatchdog
from inferd.engine_build.supervisor import BuildManager
from inferd.errors import ConfigError
from inferd.serving.rebuild import REQUESTED_BY, FallbackRebuilder
from inferd.types import Alert, BuildConfig, Peer
from inferd_client import cli_format
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, wait_until
from tests.integration.test_schemas import assert_invalid, assert_valid
from tests.unit.config.test_security_config import load_text
from tests.unit.engine_build.conftest import simulated_spec

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)
ITSELF = Peer.internal(os.getuid(), os.getpid())
#: The watchdog's period in these builds, and each simulated step's sleep: longer,
#: so the child is silent past the period between any two of its steps.
STALL_AFTER_S = 0.2
#: Two tactics for the identity model's one node: seven silent steps in all.
QUICK = {"optimization_level": 0}


# -- the config ------------------------------------------------------------------------
def test_the_config_reports_stalls_after_two_minutes_and_cancels_for_none(
    tmp_path: Path,
) -> None:
    builds = load_text(tmp_path, "").builds
    assert (builds.stall_after_s, builds.stall_cancels_after) == (120.0, 0)
    text = "[builds]\nstall_after_s = 0\nstall_cancels_after = 1000"
    builds = load_text(tmp_path, text).builds
    assert (builds.stall_after_s, builds.stall_cancels_after) == (0.0, 1000)
    for seconds in (0.1, 30, 86_400):
        assert BuildsConfig(stall_after_s=seconds).stall_after_s == seconds


@pytest.mark.parametrize("value", ["-1.0", "0.05", "86400.5", "nan", "inf"])
def test_a_stall_period_that_is_no_watchdog_is_refused_naming_the_key(
    tmp_path: Path, value: str
) -> None:
    with pytest.raises(ConfigError, match=r"builds\.stall_after_s"):
        load_text(tmp_path, f"[builds]\nstall_after_s = {value}")
    rule = r"builds\.stall_after_s must be 0 \(no stall watchdog\) or 0\.1\.\.86400 seconds"
    with pytest.raises(ConfigError, match=rule):
        BuildsConfig(stall_after_s=float(value))


@pytest.mark.parametrize("value", ["-1", "1001", "1.5", "true"])
def test_a_stall_count_out_of_range_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"builds\.stall_cancels_after"):
        load_text(tmp_path, f"[builds]\nstall_cancels_after = {value}")


# -- build.start's stall_after_s ---------------------------------------------------------
def _start_args(identity_model: Path, **header: Any) -> float:
    models = {"m": ModelConfig("m", identity_model)}
    args = parse_start({"model": "m", **header}, models, lambda: False, 3600.0, 120.0)
    return args.stall_after_s


def test_build_start_sets_one_builds_stall_period_by_the_configs_rule(
    identity_model: Path,
) -> None:
    assert _start_args(identity_model) == 120.0  # builds.stall_after_s
    assert _start_args(identity_model, stall_after_s=0) == 0.0  # off for this build
    assert _start_args(identity_model, stall_after_s=0.1) == 0.1
    assert _start_args(identity_model, stall_after_s=86_400) == 86_400.0
    for bad, got in (
        (-1, "-1"),
        (0.05, "0.05"),
        (86_401, "86401"),
        (math.nan, "nan"),
        (math.inf, "inf"),
        ("30", "a str"),
        (True, "a bool"),
    ):
        with pytest.raises(ProtocolError) as refused:
            _start_args(identity_model, stall_after_s=bad)
        assert refused.value.code is Code.INVALID_ARGUMENT
        assert refused.value.message == (
            "'stall_after_s' must be 0 (no stall watchdog) or 0.1..86400 seconds "
            f"(as builds.stall_after_s), got {got}"
        )
    with pytest.raises(ProtocolError, match="'stall_after_s' is null"):
        _start_args(identity_model, stall_after_s=None)
    # The request's schema says the same
    header = {"v": 1, "id": 1, "op": "build.start", "model": "m"}
    for seconds in (0, 0.1, 86_400):
        assert_valid("control_request.json", {**header, "stall_after_s": seconds})
    for seconds in (-1, 0.05, 86_401):
        assert_invalid("control_request.json", {**header, "stall_after_s": seconds})
    status = {"v": 1, "id": 1, "op": "build.status", "stall_after_s": 10}
    assert_invalid("control_request.json", status)


# -- the child's spec --------------------------------------------------------------------
def test_a_spec_without_the_watchdog_keys_runs_none_and_one_with_them_does(
    tmp_path: Path, identity_model: Path
) -> None:
    spec = simulated_spec(tmp_path, identity_model, step_s=0)  # an older daemon's: no keys
    _, request = child._builder(spec, BuildConfig())
    assert (request.stall_after_s, request.stall_cancels_after) == (None, None)
    off = child.stall_watchdog({"stall_after_s": 0.0, "stall_cancels_after": 3})
    assert off == {"stall_after_s": None, "stall_cancels_after": None}
    _, request = child._builder(
        {**spec, "stall_after_s": 0.5, "stall_cancels_after": 0}, BuildConfig()
    )
    # 0 is "report only": the watchdog's own 0 would cancel at the first stall
    assert (request.stall_after_s, request.stall_cancels_after) == (0.5, None)
    cancels = child.stall_watchdog({"stall_after_s": 0.5, "stall_cancels_after": 2})
    assert cancels == {"stall_after_s": 0.5, "stall_cancels_after": 2}


# -- the watchdog counts stalls in a row -----------------------------------------------------
def test_only_stalls_in_a_row_cancel_not_stalls_with_progress_between() -> None:
    adapter = ProgressAdapter("b", CancellationToken())
    adapter.phase_start("Tactic selection", None, 9)
    dog = StallWatchdog(adapter, 0.05, cancel_after_stalls=2).start()
    try:
        for count in (1, 2, 3):  # each after a step: a slow tactic, then progress
            wait_until(lambda count=count: len(dog.stalls) >= count, message=f"stall {count}")
            assert dog.stalls[-1]["inARow"] == 1
            adapter.step_complete("Tactic selection", count)
        assert not adapter.token.is_set(), "cancelled for stalls with progress between"
        wait_until(adapter.token.is_set, message="two stalls in a row cancelling")
    finally:
        dog.stop()
    assert adapter.token.source == "stall"
    assert [s["inARow"] for s in dog.stalls[-2:]] == [1, 2]


# -- daemon builds ------------------------------------------------------------------------
class Builds:
    """A real ``BuildManager`` of model ``m`` (the identity model) that keeps what it
    publishes and records."""

    def __init__(
        self, tmp_path: Path, model: Path, limits: BuildsConfig, grace_s: float = 5.0, **kwargs: Any
    ) -> None:
        state = tmp_path / "state"
        state.mkdir(mode=0o700)
        self.build_dir = state / "builds"
        self.published: list[Mapping[str, Any]] = []
        self.records: list[tuple[str, Mapping[str, Any]]] = []
        self.manager = BuildManager(
            {"m": ModelConfig("m", model)},
            build_dir=self.build_dir,
            engine_dir=state / "engines",
            publish=lambda _topic, payload: self.published.append(payload),
            record=lambda kind, payload: self.records.append((kind, payload)),
            grace_s=grace_s,
            tensorrt_available=lambda: False,
            limits=limits,
            **kwargs,
        )

    def stalled(self, build_id: str) -> list[Mapping[str, Any]]:
        return [e for e in self.published if e["buildId"] == build_id and e["type"] == "stalled"]

    def ended(self, build_id: str) -> dict[str, Any]:
        assert self.manager._get(build_id).done.wait(HANG_S), f"{build_id} never ended"
        status: dict[str, Any] = self.manager.status({"build_id": build_id})["build"]
        assert_valid("build_status_reply.json#/$defs/build", status)
        return status


@pytest.fixture
def reporting(tmp_path: Path, identity_model: Path) -> Iterator[Builds]:
    builds = Builds(tmp_path, identity_model, BuildsConfig(stall_after_s=STALL_AFTER_S))
    yield builds
    builds.manager.shutdown(wait_s=HANG_S)


def test_a_silent_daemon_build_reports_its_stalls_and_completes_when_they_only_report(
    reporting: Builds,
) -> None:
    manager = reporting.manager
    with structlog.testing.capture_logs() as logs:
        reply = manager.start(
            {
                "model": "m",
                "builder": "simulated",
                "simulation": {"step_s": 2 * STALL_AFTER_S},
                "build_config": QUICK,
            },
            OPERATOR,
        )
        build_id = reply["build_id"]
        status = reporting.ended(build_id)
    assert status["state"] == "completed" and status["cancel_source"] is None
    stalled = reporting.stalled(build_id)
    assert stalled, "no stalled event on the build topic"
    said = [e for e in logs if e["event"] == "engine_build_stalled"]
    assert len(said) == len(stalled) == status["phase_tree"]["stalls"]
    assert all(e["log_level"] == "warning" and e["build_id"] == build_id for e in said)
    assert all(e["model"] == "m" and e["silent_s"] >= STALL_AFTER_S for e in said)
    assert [e["stalls"] for e in said] == list(range(1, len(said) + 1))
    assert any(e["path"] for e in said), "no stall named the phase it was in"
    assert (status["stall_after_s"], status["stall_cancels_after"]) == (STALL_AFTER_S, 0)
    last = status["last_stall"]
    assert last["path"] == said[-1]["path"] and last["silent_s"] == said[-1]["silent_s"]
    assert last["silent_s"] == stalled[-1]["detail"]["idleS"] and last["in_a_row"] >= 1
    [started] = [e for e in logs if e["event"] == "build_started"]
    assert started["stall_after_s"] == STALL_AFTER_S


def test_a_build_its_child_cancelled_for_stalls_is_killed_after_the_grace_if_it_never_stops(
    tmp_path: Path, identity_model: Path
) -> None:
    """A builder wedged in a phase never looks at its token again.  Before (review RG):
    the daemon never took the child's own stall cancel as a cancel, so no grace ran and
    the wedged child kept its slot until its step ended (or ``builds.max_duration_s``,
    4 h); ``build.status`` said running, ``cancel_source`` null."""
    wedged_s = 10.0  # one step (the most a simulation takes): the builder does not look
    limits = BuildsConfig(stall_after_s=STALL_AFTER_S, stall_cancels_after=1)
    builds = Builds(tmp_path, identity_model, limits, grace_s=0.5)
    try:
        header = {"simulation": {"step_s": wedged_s}, "build_config": QUICK}
        build_id = builds.manager.start({"model": "m", "builder": "simulated", **header}, OPERATOR)[
            "build_id"
        ]
        started = time.monotonic()
        status = builds.ended(build_id)
        took_s = time.monotonic() - started
    finally:
        builds.manager.shutdown(wait_s=HANG_S)
    assert status["state"] == "cancelled" and status["cancel_source"] == "stall"
    assert status["escalated"] is True  # killed after the grace, as at a deadline
    assert status["cancel_reason"].startswith("no progress for ")
    assert took_s < wedged_s  # before: it ended only when its step did


def test_build_start_gives_its_child_the_watchdog_of_the_config_or_its_own(
    tmp_path: Path, identity_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs: list[dict[str, Any]] = []

    def spawn(spec: dict[str, Any]) -> Any:
        specs.append(spec)
        raise OSError("not started here")

    monkeypatch.setattr(child_process, "spawn", spawn)
    limits = BuildsConfig(stall_after_s=30.0, stall_cancels_after=2)
    manager = Builds(tmp_path, identity_model, limits).manager
    for header, stall_after_s in (
        ({}, 30.0),
        ({"stall_after_s": 0}, 0.0),
        ({"stall_after_s": 5}, 5.0),
    ):
        with pytest.raises(ProtocolError) as not_started:
            manager.start({"model": "m", "builder": "simulated", **header}, OPERATOR)
        assert not_started.value.code is Code.INTERNAL
        assert (specs[-1]["stall_after_s"], specs[-1]["stall_cancels_after"]) == (stall_after_s, 2)
    assert child.stall_watchdog(specs[1]) == {"stall_after_s": None, "stall_cancels_after": None}
    assert child.stall_watchdog(specs[2]) == {"stall_after_s": 5.0, "stall_cancels_after": 2}


def test_a_rebuild_cancelled_for_its_stalls_ends_cancelled_leaves_nothing_and_is_retried(
    tmp_path: Path, identity_model: Path
) -> None:
    alerts: list[Alert] = []
    holder: list[BuildManager] = []

    def start_build(header: dict[str, Any]) -> Mapping[str, Any]:
        # The rebuilder's build.start, its child made to go silent (simulation knobs)
        slow = {"builder": "simulated", "simulation": {"step_s": 3 * STALL_AFTER_S}}
        return holder[0].start({**header, **slow, "build_config": QUICK}, ITSELF)

    rebuilder = FallbackRebuilder(
        start_build=start_build,
        switch=lambda *_: pytest.fail("a cancelled build was adopted"),
        alert=alerts.append,
        can_build=lambda: True,
        backoff_s=3600.0,  # its retry is scheduled, never started here
        max_attempts=3,
    )
    limits = BuildsConfig(stall_after_s=STALL_AFTER_S, stall_cancels_after=1)
    builds = Builds(tmp_path, identity_model, limits, on_finished=rebuilder.on_build_finished)
    holder.append(builds.manager)
    try:
        assert rebuilder.on_fallback("m", "engine missing") is None
        build_id = str(rebuilder.describe()["m"]["build_id"])
        status = builds.ended(build_id)
        wait_until(lambda: alerts, message="the rebuilder told of the build's end")
    finally:
        rebuilder.stop()
        builds.manager.shutdown(wait_s=HANG_S)
    assert status["requested_by"] == REQUESTED_BY
    assert status["state"] == "cancelled" and status["cancel_source"] == "stall"
    assert status["cancel_reason"].startswith("no progress for ")  # the child's words
    assert status["phase_tree"]["stalls"] >= 1 and status["last_stall"]["in_a_row"] == 1
    assert status["cleanup_status"] == "cleaned" and status["engine_path"] is None
    [record] = [payload for kind, payload in builds.records if kind == "engine_build"]
    assert record["cancel_source"] == "stall" and record["outcome"] == "cancelled"
    # No partial artifact: the build's summary is all it left
    left = sorted(p.name for p in (builds.build_dir / "m").iterdir())
    assert left == [Path(status["summary_path"]).name]
    # A failed attempt, retried with back-off; not an operator's cancel (never retried)
    [alert] = alerts
    assert alert.code == "engine_build_failed" and "stall" in alert.message
    assert rebuilder.describe()["m"]["attempts"] == 1


# -- what the daemon takes of a stalled event ---------------------------------------------
def test_a_stalled_events_numbers_are_shown_only_when_they_are_numbers(tmp_path: Path) -> None:
    """The child's detail is not the daemon's: NaN, a bool or a negative are not shown."""
    build = Build(
        build_id="b1-c0ffee",
        model="m",
        builder="simulated",
        build_config={},
        engine_path=tmp_path / "m.engine",
        process=cast(Any, SimpleNamespace(pid=4242)),  # describe shows its pid
        requested_by="operator",
        peer=OPERATOR,
        started_wall_ns=0,
        started_mono=0.0,
        stall_after_s=STALL_AFTER_S,
    )
    for idle, row in ((math.nan, True), (-1.0, 0), (math.inf, "3"), (12.34567, 2)):
        event = BuildEvent(
            build_id="b1-c0ffee",
            seq=1,
            type="stalled",
            phase_id=None,
            parent_id=None,
            name=None,
            step=None,
            num_steps=None,
            mono_ns=0,
            wall_ns=0,
            thread="t",
            cancel_state="none",
            detail={"idleS": idle, "inARow": row},
        )
        assert build.tree.apply(event)
        with structlog.testing.capture_logs() as logs:
            said_stalled(build, event)
        assert build.last_stall is not None
        [said] = logs
        assert said["silent_s"] == build.last_stall["silent_s"]
    assert build.last_stall == {
        "path": [],
        "silent_s": 12.346,
        "in_a_row": 2,
        "wall_ns": build.last_stall["wall_ns"],
    }
    assert said["stalls"] == 4
    # inferctl build status ID shows it (the listing has no last_stall: no line)
    shown = cli_format.build(describe(build))
    assert "  last stall: 12.3 s without progress at (before a phase) (2 in a row)" in shown
    assert "last stall" not in "\n".join(cli_format.build(describe(build, listed=True)))
