"""A background rebuild does not override an operator's switch (``serving/rebuild.py``
``_adopt``, ``serving/switching.py`` ``switch_now``): a model that an operator switched
while its engine was rebuilt keeps what the operator chose when the build completes.

The real switcher and rebuilder; a slot whose preparations are fakes (``prepare``), and
a thread standing in for the engine worker that runs the swaps queued for it."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog

from inferd.config import ModelConfig, RuntimeConfig
from inferd.serving.rebuild import FallbackRebuilder
from inferd.serving.scheduler import Scheduler, SchedulerClosedError
from inferd.serving.slot import ModelSlot, Sinks
from inferd.serving.switching import RuntimeSwitcher
from inferd.types import Alert, EngineHandle, Peer, ThermalState
from inferd_wire.protocol import ProtocolError
from tests.conftest import HANG_S
from tests.unit.serving.test_execution_failover import Finished
from tests.unit.serving.test_switching import SPEC, Released


@dataclass
class Rig:
    slot: ModelSlot
    switcher: RuntimeSwitcher
    rebuilder: FallbackRebuilder
    alerts: list[Alert]
    records: list[tuple[str, dict[str, Any]]]
    builds: list[dict[str, Any]]

    def operator_switch(self, label: str) -> dict[str, Any] | ProtocolError:
        replies: queue.Queue[dict[str, Any] | ProtocolError] = queue.Queue()
        header = {"model": "m", "runtime": label, "requested_by": "ground"}
        self.switcher.switch(header, Peer.internal(0, 0), replies.put)
        return replies.get(timeout=HANG_S)


def starting(builds: list[dict[str, Any]]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A ``start_build`` that counts the builds asked for into ``builds``."""

    def start_build(request: dict[str, Any]) -> dict[str, Any]:
        builds.append(request)
        return {"build_id": f"b{len(builds)}"}

    return start_build


def rebuilder_of(
    switcher: RuntimeSwitcher,
    alerts: list[Alert],
    builds: list[dict[str, Any]],
    *,
    backoff_s: float = 0.0,
    max_attempts: int = 3,
) -> FallbackRebuilder:
    """The real rebuilder over ``switcher``, as the daemon makes it: the builds it asks
    for counted into ``builds`` (``starting``), its alerts into ``alerts``."""
    return FallbackRebuilder(
        start_build=starting(builds),
        switch=switcher.switch_now,
        switcher=switcher,
        alert=alerts.append,
        can_build=lambda: True,
        backoff_s=backoff_s,
        max_attempts=max_attempts,
    )


def swap_worker(scheduler: Scheduler) -> threading.Thread:
    """A started thread standing in for the engine worker: it runs the swaps queued
    for it between requests, until ``scheduler`` is closed."""

    def worker() -> None:
        while True:
            try:
                call = scheduler.take(timeout=None)
            except SchedulerClosedError:
                return
            assert callable(call)
            call()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    slot = ModelSlot(ModelConfig(name="m", path=tmp_path / "m.onnx", runtime="tensorrt"))
    slot.runtime = Released()  # type: ignore[assignment]
    # On the fallback, as activation leaves a model whose engine is missing.
    slot.handle = EngineHandle(1, "onnx_trt_ep", "0" * 64, SPEC, SPEC, is_fallback=True)
    slot.state = "serving"
    ids = iter(range(2, 100))

    def prepare(label: str, *_args: Any, **_kwargs: Any) -> tuple[Any, EngineHandle]:
        # ``is_fallback`` defaults to False, as ``ModelSlot.prepare``'s does for a switch.
        return Released(), EngineHandle(next(ids), label, "0" * 64, SPEC, SPEC)

    slot.prepare = prepare  # type: ignore[method-assign]
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")
    alerts: list[Alert] = []
    records: list[tuple[str, dict[str, Any]]] = []
    sinks = Sinks(
        alert=alerts.append,
        events=lambda topic, payload: None,
        record=lambda kind, payload: records.append((kind, dict(payload))),
        thermal=ThermalState.unavailable,
    )
    config = RuntimeConfig(ort_trt_cache_dir=tmp_path / "ort", engine_dir=tmp_path / "engines")
    switcher = RuntimeSwitcher({"m": slot}, scheduler, config, sinks)
    builds: list[dict[str, Any]] = []
    rebuilder = rebuilder_of(switcher, alerts, builds)
    thread = swap_worker(scheduler)
    yield Rig(slot, switcher, rebuilder, alerts, records, builds)
    rebuilder.stop()
    switcher.stop(HANG_S)
    scheduler.close()
    thread.join(HANG_S)


@pytest.mark.parametrize("operator_label", ["onnx_trt_ep", "tensorrt"])
def test_a_rebuild_completing_after_an_operator_switch_leaves_the_operators_choice(
    rig: Rig, operator_label: str
) -> None:
    """The model fell back and its engine is being rebuilt; the ground switches it (to
    ``onnx_trt_ep`` on purpose, or to an engine of its own).  When the build completes the
    daemon does not switch it again: no second ``runtime_switch``, no alert, no retry.
    Before: the daemon switched it to the rebuilt engine behind the operator's back."""
    rig.rebuilder.on_fallback("m", "engine missing")
    assert [build["model"] for build in rig.builds] == ["m"]
    reply = rig.operator_switch(operator_label)
    assert isinstance(reply, dict) and reply["to_runtime"] == operator_label
    chosen = rig.slot.handle
    assert chosen is not None

    with structlog.testing.capture_logs() as logs:
        rig.rebuilder.on_build_finished(Finished("b1", model="m"))

    assert rig.slot.handle is chosen  # the operator's choice stands
    switches = [payload for kind, payload in rig.records if kind == "runtime_switch"]
    assert [payload["requested_by"] for payload in switches] == ["ground"]
    assert rig.alerts == []  # the build did not fail
    assert len(rig.builds) == 1  # and is not retried
    assert rig.rebuilder.describe()["m"]["adopted"] is False
    (line,) = [line for line in logs if line["event"] == "engine_rebuild_superseded"]
    assert line["model"] == "m" and line["build_id"] == "b1"
    assert "where an operator switched it" in line["reason"]
    assert rig.switcher.claim("m")  # nothing left the model claimed


def test_a_rebuild_completing_on_the_fallback_is_still_adopted(rig: Rig) -> None:
    """The rule's other side: a model still on the fallback is switched to the rebuilt
    engine, once, by the daemon."""
    rig.rebuilder.on_fallback("m", "engine missing")
    rig.rebuilder.on_build_finished(Finished("b1", model="m"))
    handle = rig.slot.handle
    assert handle is not None and handle.runtime_label == "tensorrt"
    switches = [payload for kind, payload in rig.records if kind == "runtime_switch"]
    assert [payload["requested_by"] for payload in switches] == ["inferd: build b1"]
    assert rig.rebuilder.describe()["m"]["adopted"] is True
    assert rig.alerts == []


def test_a_failover_after_the_operators_switch_lifts_the_rule(rig: Rig) -> None:
    """The operator's engine failed over since (a new fallback engine serves): the
    rebuilt engine is adopted again, as for any model on the fallback."""
    rig.rebuilder.on_fallback("m", "engine missing")
    assert isinstance(rig.operator_switch("tensorrt"), dict)
    # What ``ExecutionFailover`` does on the worker (``ModelSlot.swap``) when it fails.
    fallback = EngineHandle(50, "onnx_trt_ep", "0" * 64, SPEC, SPEC, is_fallback=True)
    rig.slot.swap(Released(), fallback, "tensorrt failed while serving")  # type: ignore[arg-type]
    rig.rebuilder.on_build_finished(Finished("b1", model="m"))
    handle = rig.slot.handle
    assert handle is not fallback and handle is not None and handle.runtime_label == "tensorrt"
    assert rig.rebuilder.describe()["m"]["adopted"] is True
