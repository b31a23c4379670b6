"""The build ops' free text is recorded as sent (``build.status``, the ``build``
event, the FDR record, the journal): ``build.start``'s ``requested_by`` and
``simulation.fail`` and ``build.cancel``'s ``reason`` that are not printable are
refused ``INVALID_ARGUMENT`` naming the character, before anything changes (no
rate token, no child, no record; the build a refused cancel names goes on).  They
were checked for their length only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from inferd.config import ModelConfig
from inferd.engine_build import child_process
from inferd.engine_build.start_refusals import CountedBuildManager
from inferd.engine_build.supervisor import BuildManager
from inferd.types import Peer
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S
from tests.unit.client.test_review_free_text_wire import FORBIDDEN, PRINTABLE, refusal

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)
SIMULATED = {"model": "demo", "builder": "simulated"}
#: A build that is still running when the test cancels it: one second a step.
SLOW = {"step_s": 1.0}


class Builds:
    """A build manager over ``model`` whose records and started children are kept."""

    def __init__(self, tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.records: list[dict[str, Any]] = []
        self.spawned: list[dict[str, Any]] = []
        state = tmp_path / "state"
        state.mkdir(mode=0o700)
        self.manager = CountedBuildManager(
            {"demo": ModelConfig("demo", model)},
            build_dir=state / "builds",
            engine_dir=state / "engines",
            publish=lambda _topic, _payload: None,
            record=lambda _kind, payload: self.records.append(dict(payload)),
            grace_s=1.0,  # a child slow to stop (a loaded machine) is killed soon
            tensorrt_available=lambda: False,
        )
        spawn = child_process.spawn

        def counted(spec: dict[str, Any]) -> Any:
            self.spawned.append(spec)
            return spawn(spec)

        monkeypatch.setattr(child_process, "spawn", counted)

    def start(self, header: dict[str, Any]) -> dict[str, Any]:
        return self.manager.start(header, OPERATOR)


def whole_burst(manager: BuildManager) -> bool:
    """Whether the operator may still start ``burst`` builds (nothing was taken)."""
    limit = manager.admission.start_limit
    for _ in range(limit.burst):
        if limit.retry_after(OPERATOR.key) is not None:
            return False
        limit.take(OPERATOR.key)
    return True


START_FIELDS = {
    "requested_by": lambda text: {**SIMULATED, "requested_by": text},
    "simulation.fail": lambda text: {**SIMULATED, "simulation": {"fail": text}},
}


@pytest.mark.parametrize("field", START_FIELDS)
@pytest.mark.parametrize("text", FORBIDDEN.values(), ids=FORBIDDEN.keys())
def test_build_start_refuses_free_text_that_is_not_printable_before_anything(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch, field: str, text: str
) -> None:
    builds = Builds(tmp_path, demo_model, monkeypatch)
    with pytest.raises(ProtocolError) as refused:
        builds.start(START_FIELDS[field](text))
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert refused.value.message == refusal(field, text)
    assert builds.spawned == [] and builds.records == []
    assert builds.manager.status({})["builds"] == []
    assert whole_burst(builds.manager)


def test_build_start_and_cancel_take_printable_text_in_any_script(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = Builds(tmp_path, demo_model, monkeypatch)
    started = builds.start({**SIMULATED, "requested_by": PRINTABLE[0], "simulation": SLOW})
    build_id = started["build_id"]
    reply = builds.manager.cancel({"build_id": build_id, "reason": PRINTABLE[1]}, OPERATOR)
    assert reply["accepted"] is True
    build = builds.manager._get(build_id)
    assert build.done.wait(HANG_S)
    assert (build.requested_by, build.cancel_reason) == PRINTABLE[:2]
    assert builds.records[-1]["cancel_reason"] == PRINTABLE[1]


def test_build_cancel_refuses_a_reason_that_is_not_printable_and_the_build_goes_on(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = Builds(tmp_path, demo_model, monkeypatch)
    build_id = builds.start({**SIMULATED, "simulation": SLOW})["build_id"]
    build = builds.manager._get(build_id)
    try:
        for name, text in FORBIDDEN.items():
            with pytest.raises(ProtocolError) as refused:
                builds.manager.cancel({"build_id": build_id, "reason": text}, OPERATOR)
            assert refused.value.code is Code.INVALID_ARGUMENT, name
            assert refused.value.message == refusal("reason", text)
            assert build.state == "running" and build.cancel_source is None, name
            assert build.cancel_reason is None and builds.records == [], name
    finally:
        builds.manager.shutdown("sigterm", wait_s=HANG_S)
    assert build.done.is_set() and build.cancel_source == "sigterm"
