"""``builds.max_running``: at most that many builds run at once, the daemon's own
rebuilds included (``admission.BuildAdmission.room``, ``supervisor.BuildManager.start``,
``serving/rebuild.py``).

Before, nothing but one build per model bounded the build children: with N models an
operator, or the daemon's own rebuilds, started N children at once, each with its own
memory (on a Jetson a TensorRT builder and GPU memory each).  Real ``BuildManager``s
with stand-in children started as ``child_process.spawn`` starts one, that wait for
the cancel on their stdin and exit."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from inferd.config import BuildsConfig, ModelConfig
from inferd.engine_build.build_record import BuildFinished
from inferd.engine_build.supervisor import BuildManager
from inferd.errors import ConfigError
from inferd.serving.rebuild import REQUESTED_BY, FallbackRebuilder
from inferd.types import Alert, Peer
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, wait_until
from tests.integration.test_schemas import assert_valid
from tests.unit.config.test_config import MINIMAL, load_text
from tests.unit.engine_build.conftest import build_manager, stand_in_children

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)
ITSELF = Peer.internal(os.getuid(), os.getpid())
#: A stand-in build child: runs until the cancel arrives on its stdin, then exits.
_UNTIL_CANCELLED = "import sys\nsys.stdin.buffer.read(1)\n"


@pytest.fixture
def children(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_children(monkeypatch, _UNTIL_CANCELLED)


def _start(manager: BuildManager, model: str, peer: Peer = OPERATOR) -> str:
    return str(manager.start({"model": model, "builder": "simulated"}, peer)["build_id"])


def _end(manager: BuildManager, build_id: str) -> None:
    assert manager.cancel({"build_id": build_id}, OPERATOR)["accepted"] is True
    assert manager._get(build_id).done.wait(HANG_S), f"{build_id} never ended"


@pytest.fixture
def three_models(tmp_path: Path, demo_model: Path, children: None) -> Iterator[BuildManager]:
    manager = build_manager(
        tmp_path,
        dict.fromkeys(("a", "b", "c"), demo_model),
        grace_s=5.0,
        limits=BuildsConfig(start_burst=3, start_refill_s=86_400.0, max_running=2),
    )
    yield manager
    manager.shutdown(wait_s=HANG_S)


def test_a_start_past_max_running_is_refused_naming_the_running_builds_and_changes_nothing(
    three_models: BuildManager, tmp_path: Path
) -> None:
    manager = three_models
    first, second = _start(manager, "a"), _start(manager, "b")
    with structlog.testing.capture_logs() as logs, pytest.raises(ProtocolError) as refused:
        _start(manager, "c")
    assert refused.value.code == Code.RESOURCE_EXHAUSTED
    message = refused.value.message
    assert "builds.max_running is 2" in message and "raise builds.max_running" in message
    assert f"{first} (model 'a')" in message and f"{second} (model 'b')" in message
    assert [e["running"] for e in logs if e["event"] == "build_start_over_max_running"] == [
        [first, second]
    ]
    # Nothing changed: no build, no id used, no folder made for it.
    assert sorted(manager._builds) == sorted([first, second])
    assert not (tmp_path / "state" / "builds" / "c").exists()
    listing = manager.status({})
    assert listing["running_limit"] == {"max_running": 2, "running": 2, "refused": 1}
    assert all("phases_dropped" not in b["events"] for b in listing["builds"])  # none dropped
    assert_valid(
        "build_status_reply.json#/$defs/ok", {"v": 1, "id": 1, "ok": True, "result": listing}
    )
    # Once one ends there is room, and the refused start had not used up the peer's
    # rate: its third start of a burst of 3 (one a day after) is let through.
    _end(manager, first)
    third = _start(manager, "c")
    assert third.startswith("b3-")  # the refusal took no id
    assert manager.status({})["running_limit"] == {"max_running": 2, "running": 2, "refused": 1}


def test_the_daemons_own_rebuild_is_held_to_max_running_too(three_models: BuildManager) -> None:
    manager = three_models
    for model in ("a", "b"):
        _start(manager, model)
    with pytest.raises(ProtocolError) as refused:
        manager.start({"model": "c", "requested_by": REQUESTED_BY}, ITSELF)
    assert refused.value.code == Code.RESOURCE_EXHAUSTED
    assert "builds.max_running" in refused.value.message


@pytest.mark.parametrize("value", [0, 65, -1])
def test_max_running_is_1_to_64(tmp_path: Path, value: int) -> None:
    assert load_text(tmp_path, MINIMAL).builds.max_running == 2
    assert load_text(tmp_path, "[builds]\nmax_running = 64\n" + MINIMAL).builds.max_running == 64
    with pytest.raises(ConfigError, match=r"builds\.max_running must be 1\.\.64"):
        load_text(tmp_path, f"[builds]\nmax_running = {value}\n" + MINIMAL)


# -- the daemon's own rebuild refused for room: it waits for a build to end ------------------


class _Daemon:
    """The daemon's wiring of a real ``BuildManager`` (``builds.max_running = 1``) and
    the rebuilder: its rebuilds start as the daemon's own peer, and every build's end
    is the rebuilder's news (``Daemon._on_build_finished``)."""

    def __init__(self, tmp_path: Path, demo_model: Path) -> None:
        self.alerts: list[Alert] = []
        #: Builds whose end the rebuilder has been told of (and has acted on).
        self.told: list[str] = []
        state = tmp_path / "state"
        state.mkdir(mode=0o700)
        self.manager = BuildManager(
            {name: ModelConfig(name, demo_model) for name in ("a", "b")},
            build_dir=state / "builds",
            engine_dir=state / "engines",
            publish=lambda _topic, _payload: None,
            record=lambda _kind, _payload: None,
            grace_s=5.0,
            tensorrt_available=lambda: False,
            limits=BuildsConfig(max_running=1),
            on_finished=self._finished,
        )
        self.rebuilder = FallbackRebuilder(
            start_build=lambda header: self.manager.start(header, ITSELF),
            switch=lambda *_args: {},
            alert=self.alerts.append,
            can_build=lambda: True,
            backoff_s=0.0,
            max_attempts=3,
        )

    def _finished(self, finished: BuildFinished) -> None:
        self.rebuilder.on_build_finished(finished)
        self.told.append(finished.build_id)

    def close(self) -> None:
        self.rebuilder.stop()
        self.manager.shutdown(wait_s=HANG_S)


@pytest.fixture
def daemon(tmp_path: Path, demo_model: Path, children: None) -> Iterator[_Daemon]:
    wired = _Daemon(tmp_path, demo_model)
    yield wired
    wired.close()


def test_a_rebuild_refused_for_room_waits_and_starts_when_a_build_ends(daemon: _Daemon) -> None:
    """Before, the refusal was an ``engine_build_failed`` alert ("could not start"), an
    attempt used, and the rebuild dropped: the model stayed on the fallback until it
    fell back again."""
    operators = _start(daemon.manager, "a")
    with structlog.testing.capture_logs() as logs:
        assert daemon.rebuilder.on_fallback("b", "engine missing") is None  # under way
    (waiting,) = [e for e in logs if e["event"] == "engine_rebuild_waiting"]
    assert waiting["model"] == "b" and "builds.max_running" in waiting["refusal"]
    assert daemon.alerts == []
    assert daemon.rebuilder.describe()["b"]["attempts"] == 0  # none of rebuild_max_attempts
    assert daemon.rebuilder.on_fallback("b", "engine missing") is None  # asked once only
    assert len(daemon.manager._builds) == 1
    _end(daemon.manager, operators)  # its end is the rebuilder's news
    rebuild = wait_until(
        lambda: daemon.rebuilder.describe()["b"]["build_id"], message="the rebuild started"
    )
    build = daemon.manager._get(rebuild)
    assert build.model == "b" and build.requested_by == REQUESTED_BY and build.state == "running"
    assert daemon.rebuilder.describe()["b"]["attempts"] == 1
    assert daemon.alerts == []


def test_an_operators_switch_cancels_a_rebuild_that_waits_for_room(daemon: _Daemon) -> None:
    operators = _start(daemon.manager, "a")
    daemon.rebuilder.on_fallback("b", "engine missing")
    with structlog.testing.capture_logs() as logs:
        daemon.rebuilder.operator_chose("b")
    assert [e["model"] for e in logs if e["event"] == "engine_rebuild_retry_cancelled"] == ["b"]
    _end(daemon.manager, operators)
    wait_until(lambda: operators in daemon.told, message="the rebuilder told of its end")
    assert sorted(daemon.manager._builds) == [operators]  # no rebuild started at its end
    assert daemon.rebuilder.describe()["b"]["build_id"] is None


def test_a_build_whose_reader_cannot_start_wakes_a_rebuild_waiting_for_room(
    daemon: _Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, only ``_finish`` told ``on_finished``: a build abandoned because its
    reader thread could not start (``BuildManager._abandon``) left the running set
    untold, and the rebuild waiting for its room waited for some other build's end."""
    start = threading.Thread.start
    failed: list[str] = []

    def fails_once(thread: threading.Thread) -> None:
        if thread.name.startswith("inferd-build-") and not failed:
            failed.append(thread.name.removeprefix("inferd-build-"))
            # The operator's build is in the running set: the rebuild waits for room.
            assert daemon.rebuilder.on_fallback("b", "engine missing") is None
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", fails_once)
    with pytest.raises(ProtocolError) as refused:
        _start(daemon.manager, "a")
    assert refused.value.code == Code.INTERNAL
    assert daemon.told == failed  # told of the abandoned build, before the refusal
    rebuild = daemon.rebuilder.describe()["b"]["build_id"]
    assert rebuild is not None, "the rebuild still waits for room"
    assert daemon.manager._get(rebuild).state == "running" and daemon.alerts == []


def test_a_build_whose_end_could_not_be_recorded_wakes_a_rebuild_waiting_for_room(
    daemon: _Daemon,
) -> None:
    """Before, a build whose ``_finish`` raised (here at its FDR record), ended by
    ``settle``, never told ``on_finished`` either."""
    operators = _start(daemon.manager, "a")
    assert daemon.rebuilder.on_fallback("b", "engine missing") is None  # waits for room

    def recorder_gone(_kind: str, _payload: object) -> None:
        raise OSError("the recorder is gone")

    daemon.manager._record = recorder_gone
    with structlog.testing.capture_logs() as logs:
        _end(daemon.manager, operators)
        rebuild = wait_until(
            lambda: daemon.rebuilder.describe()["b"]["build_id"], message="the rebuild started"
        )
    assert [e["build_id"] for e in logs if e["event"] == "build_finish_failed"] == [operators]
    assert daemon.told[0] == operators and daemon.manager._get(rebuild).model == "b"


def _ended(build_id: str, model: str) -> BuildFinished:
    """An operator's build that failed (the rebuilder acts on none but its own)."""
    return BuildFinished(
        build_id, model, "failed", "simulated", False, None, Path("x"), "ops", "it failed"
    )


def test_a_build_that_ends_between_the_refusal_and_the_wait_starts_the_rebuild_at_once() -> None:
    """The room a build's end made while the refusal was on its way is not missed: its
    news found no rebuild waiting yet, and no later end may come."""
    alerts: list[Alert] = []
    calls: list[dict[str, Any]] = []
    rebuilder: FallbackRebuilder

    def start_build(header: dict[str, Any]) -> dict[str, Any]:
        calls.append(header)
        if len(calls) == 1:  # the other build ends after the refusal was decided
            rebuilder.on_build_finished(_ended("b9", "other"))
            raise ProtocolError(Code.RESOURCE_EXHAUSTED, "builds.max_running is 1")
        return {"build_id": "b10"}

    rebuilder = FallbackRebuilder(
        start_build=start_build,
        switch=lambda *_args: {},
        alert=alerts.append,
        can_build=lambda: True,
        backoff_s=0.0,
        max_attempts=3,
    )
    assert rebuilder.on_fallback("m", "engine missing") is None
    assert len(calls) == 2 and rebuilder.describe()["m"]["build_id"] == "b10"
    assert rebuilder.describe()["m"]["attempts"] == 1 and alerts == []
