"""``build.start``'s refusals counted by code for ``status.builds`` and the metric
``inferd_build_start_refused_total`` (``engine_build/start_refusals.py``): before,
only the rate's own refusals were counted, and only in ``build.status``.  No build
process is started: each request is refused before one would be."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from inferd.config import ModelConfig
from inferd.engine_build import child_process
from inferd.engine_build.start_refusals import CountedBuildManager
from inferd.types import Peer
from inferd_wire.protocol import Code, ProtocolError

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)


def manager(tmp_path: Path) -> CountedBuildManager:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (tmp_path / "demo.onnx").write_bytes(b"")
    models = {
        "demo": ModelConfig("demo", tmp_path / "demo.onnx"),
        "gone": ModelConfig("gone", tmp_path / "gone.onnx"),
    }
    return CountedBuildManager(
        models,
        build_dir=state / "builds",
        engine_dir=state / "engines",
        publish=lambda _topic, _payload: None,
        record=lambda _kind, _payload: None,
        grace_s=1.0,
        tensorrt_available=lambda: False,
    )


def refused(builds: CountedBuildManager, header: dict[str, Any], peer: Peer = OPERATOR) -> Code:
    with pytest.raises(ProtocolError) as error:
        builds.start(header, peer)
    return error.value.code


def test_each_refusal_is_counted_under_its_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = manager(tmp_path)
    assert builds.start_status()["start_refused"] == {}
    simulated = {"model": "demo", "builder": "simulated"}
    assert refused(builds, {"model": "nope"}) == Code.NOT_FOUND
    assert refused(builds, {**simulated, "builder": "fast"}) == Code.INVALID_ARGUMENT
    assert refused(builds, {**simulated, "simulation": {"x": 1}}) == Code.INVALID_ARGUMENT
    assert refused(builds, {**simulated, "model": "gone"}) == Code.FAILED_PRECONDITION

    def no_process(_spec: dict[str, Any]) -> Any:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(child_process, "spawn", no_process)
    assert refused(builds, simulated) == Code.INTERNAL
    # The peer's rate used up: refused by it, counted by code and by the rate.
    limit = builds.admission.start_limit
    for _ in range(limit.burst):
        limit.take(OPERATOR.key)
    assert refused(builds, simulated) == Code.RESOURCE_EXHAUSTED
    # The daemon's own rebuild is not a build.start op: refused, not counted.
    assert refused(builds, {"model": "nope"}, Peer.internal(os.getuid(), os.getpid()))
    assert builds.start_status() == {
        "start_refused": {
            "NOT_FOUND": 1,
            "INVALID_ARGUMENT": 2,
            "FAILED_PRECONDITION": 1,
            "INTERNAL": 1,
            "RESOURCE_EXHAUSTED": 1,
        },
        "start_limit": {"burst": limit.burst, "refill_s": limit.refill_s, "refused": 1},
        "running_limit": {"max_running": builds.admission.max_running, "running": 0, "refused": 0},
    }
