"""The timing-cache decision a build starts with, while it runs (DESIGN.md 274, left).

Whether the stored cache was loaded (``reused``), there was none (``cold``) or it
was quarantined is known when the build starts (the child's ``TimingCacheManager``),
but ``build.status`` and the ``build`` events said nothing of the timing cache
until the build ended.  Now the build's first event carries it
(``detail.timingCacheMode``, as a rule on its first ``phase_start``), and
``build.status`` reports it as ``timing_cache_start`` from then on.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from inferd.config import ModelConfig
from inferd.engine_build import BuildRequest, run_build
from inferd.engine_build.child import SIMULATED_HOST
from inferd.engine_build.events import BuildEvent, PhaseTree
from inferd.engine_build.simulated import SimulatedBuilder, host_key
from inferd.engine_build.supervisor import BuildManager
from inferd.engines.timing_cache import timing_cache_path
from inferd.types import BuildConfig, Peer
from inferd_client import cli_format
from tests.conftest import HANG_S
from tests.integration.test_schemas import assert_valid
from tests.unit.engine_build.conftest import HOST

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)


def _events_of_a_build(engine_dir: Path, model: Path) -> list[BuildEvent]:
    events: list[BuildEvent] = []
    request = BuildRequest(model, engine_dir / "demo.engine", BuildConfig(), HOST)
    run_build(request, SimulatedBuilder(model, request.build_config, HOST), listener=events.append)
    return events


def test_the_first_event_of_a_build_carries_the_decision_it_starts_with(
    tmp_path: Path, demo_model: Path
) -> None:
    """No stored cache: ``cold``; the cache the first build saved: ``reused``; an
    empty file: ``quarantined``.  Only the first event (its first phase's start)
    carries it, and the phase tree folded from the events keeps it."""
    seen = []
    for prepare in (None, None, lambda path: path.write_bytes(b"")):
        if prepare is not None:
            prepare(timing_cache_path(tmp_path, HOST))
        events = _events_of_a_build(tmp_path, demo_model)
        first, *rest = events
        assert (first.type, first.name) == ("phase_start", "Building engine")
        assert [e.seq for e in rest if "timingCacheMode" in e.detail] == []
        assert PhaseTree.from_events(events).timing_cache_start == first.detail["timingCacheMode"]
        seen.append(first.detail["timingCacheMode"])
    assert seen == ["cold", "reused", "quarantined"]


def test_build_status_and_the_follow_view_show_it_while_the_build_runs(
    tmp_path: Path, demo_model: Path
) -> None:
    """Through the daemon's build manager and a real build child: a stored cache is
    ``reused`` in ``build.status``, its text and the published ``phase_start``
    while the build runs (``timing_cache_mode`` still null); after a cancel the
    start stays and the outcome is ``discarded``."""
    state = tmp_path / "state"
    # A simulated build's engine, and so its timing cache, is in the builds dir.
    folder = state / "builds" / "demo"
    for path in (state, folder.parent, folder):
        path.mkdir(mode=0o700)
    stored = timing_cache_path(folder, SIMULATED_HOST)
    stored.write_text(json.dumps({"host": host_key(SIMULATED_HOST), "entries": []}))
    stored.chmod(0o600)
    published: list[dict[str, Any]] = []
    started = threading.Event()

    def publish(topic: str, payload: Any) -> None:
        if topic == "build":
            published.append(dict(payload))
            if payload["type"] == "phase_start":
                started.set()

    manager = BuildManager(
        {"demo": ModelConfig("demo", demo_model)},
        build_dir=folder.parent,
        engine_dir=state / "engines",
        publish=publish,
        record=lambda _kind, _payload: None,
        grace_s=HANG_S,
        tensorrt_available=lambda: False,
    )
    header = {"model": "demo", "builder": "simulated", "simulation": {"step_s": 0.2}}
    build_id = manager.start(header, OPERATOR)["build_id"]
    try:
        assert started.wait(HANG_S)
        running = manager.status({"build_id": build_id})["build"]
    finally:
        manager.cancel({"build_id": build_id}, OPERATOR)
    assert_valid("build_status_reply.json#/$defs/build", running)
    assert running["state"] == "running"
    assert (running["timing_cache_start"], running["timing_cache_mode"]) == ("reused", None)
    assert "  timing_cache_start: reused" in cli_format.build(running)
    first = published[0]
    assert_valid("event_build.json", {**first, "ts_ns": 1, "seq": 1})
    assert first["detail"] == {"timingCacheMode": "reused"}
    assert cli_format.build_event(first, {}) == (
        "+ Building engine (4 steps) timing cache at start: reused"
    )

    assert manager._get(build_id).done.wait(HANG_S)
    ended = manager.status({"build_id": build_id})["build"]
    assert (ended["timing_cache_start"], ended["timing_cache_mode"]) == ("reused", "discarded")
    assert ended["state"] == "cancelled"
