"""A failover while serving keeps its reason and says whether a background build is asked
for (review D, F5: ``serving/failover.py`` ``_fail_over``, ``_swap``; ``daemon.py``
``_rebuild_if_fallback``; ``serving/rebuild.py`` ``on_fallback``).

Before: a model configured ``onnx_trt_ep`` that an operator had switched to ``tensorrt``
failed over with ``reason: None`` (status, the ``runtime`` event), and the alert ended
"a rebuilt, validated engine may serve again" although no build is ever asked for such
a model, nor for a model whose builds this run are spent.

The real failover, switcher, rebuilder and the daemon's ``_rebuild_if_fallback``; the
slot's preparations are fakes, and a thread stands in for the engine worker."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from inferd.config import ModelConfig, RuntimeConfig
from inferd.daemon import Daemon
from inferd.errors import ExecutionFailedError
from inferd.serving.failover import ALERT_CODE, ExecutionFailover
from inferd.serving.rebuild import FallbackRebuilder
from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.serving.switching import RuntimeSwitcher
from inferd.types import Alert, EngineHandle, ThermalState
from tests.conftest import HANG_S, wait_until
from tests.unit.serving.test_execution_failover import Finished
from tests.unit.serving.test_review_switch_rebuild import rebuilder_of, swap_worker
from tests.unit.serving.test_switching import SPEC, Released

ERROR = "execute_async_v3 returned False"


@dataclass
class Rig:
    slot: ModelSlot
    failover: ExecutionFailover
    switcher: RuntimeSwitcher
    rebuilder: FallbackRebuilder
    alerts: list[Alert]
    events: list[dict[str, Any]]
    builds: list[dict[str, Any]]

    def fail_over(self) -> Alert:
        """One execution failure (the threshold is 1); the failover's alert, once the
        failover thread has given the model back."""
        self.failover.failed(self.slot, ExecutionFailedError(ERROR))
        wait_until(lambda: self.switcher.claim("demo"), message="the model given back")
        self.switcher.unclaim("demo")
        (alert,) = [alert for alert in self.alerts if alert.code == ALERT_CODE]
        return alert


@pytest.fixture
def rig_for(tmp_path: Path) -> Iterator[Any]:
    stops: list[Any] = []

    def make(configured: str, *, max_attempts: int = 3, attempts_spent: int = 0) -> Rig:
        """A model configured ``configured`` serving on ``tensorrt`` (an operator's
        switch, for ``onnx_trt_ep``), with ``attempts_spent`` builds made this run."""
        slot = ModelSlot(ModelConfig(name="demo", path=tmp_path / "m.onnx", runtime=configured))
        slot.runtime = Released()  # type: ignore[assignment]
        slot.handle = EngineHandle(1, "tensorrt", "0" * 64, SPEC, SPEC, ("TensorRT",))
        slot.state = "serving"
        ids = iter(range(2, 100))

        def prepare(
            label: str, _config: RuntimeConfig, _sinks: Any, is_fallback: bool = False
        ) -> tuple[Any, EngineHandle]:
            handle = EngineHandle(next(ids), label, "0" * 64, SPEC, SPEC, is_fallback=is_fallback)
            return Released(), handle

        slot.prepare = prepare  # type: ignore[method-assign]
        scheduler = Scheduler()
        scheduler.add_model("demo", 4, "fifo")
        alerts: list[Alert] = []
        events: list[dict[str, Any]] = []
        sinks = Sinks(
            alert=alerts.append,
            events=lambda topic, payload: events.append(dict(payload)),
            record=lambda kind, payload: None,
            thermal=ThermalState.unavailable,
        )
        config = RuntimeConfig(
            ort_trt_cache_dir=tmp_path / "ort",
            engine_dir=tmp_path / "engines",
            tensorrt_failover_after_errors=1,
        )
        switcher = RuntimeSwitcher({"demo": slot}, scheduler, config, sinks)
        builds: list[dict[str, Any]] = []
        rebuilder = rebuilder_of(switcher, alerts, builds, max_attempts=max_attempts)
        for spent in range(1, attempts_spent + 1):  # builds made earlier in this run: failed
            rebuilder.on_fallback("demo", "no engine", "EngineMissingError")
            rebuilder.on_build_finished(Finished(f"b{spent}", state="failed", error="x"))
        builds.clear()
        alerts.clear()
        daemon = cast(Daemon, SimpleNamespace(rebuilder=rebuilder))
        failover = ExecutionFailover(
            scheduler,
            switcher,
            config,
            sinks,
            lambda slot: Daemon._rebuild_if_fallback(daemon, slot),
            not_rebuilt=lambda slot: Daemon._rebuild_if_fallback(daemon, slot, ask=False),
        )
        thread = swap_worker(scheduler)
        stops.append((rebuilder, failover, switcher, scheduler, thread))
        return Rig(slot, failover, switcher, rebuilder, alerts, events, builds)

    yield make
    for rebuilder, failover, switcher, scheduler, thread in stops:
        rebuilder.stop()
        failover.stop(HANG_S)
        switcher.stop(HANG_S)
        scheduler.close()
        thread.join(HANG_S)


def test_a_model_configured_onnx_trt_ep_keeps_the_failovers_reason(rig_for: Any) -> None:
    """An operator switched a model configured ``onnx_trt_ep`` to ``tensorrt``; its engine
    fails while serving.  It is back on its configured runtime (not a fallback), and
    status and the ``runtime`` event say why; the alert says no engine is rebuilt, and
    none is asked for.  Before: ``reason`` None, and "may serve again"."""
    rig: Rig = rig_for("onnx_trt_ep")

    alert = rig.fail_over()

    description = rig.slot.describe_runtime()
    assert (description["configured_runtime"], description["runtime"]) == (
        "onnx_trt_ep",
        "onnx_trt_ep",
    )
    assert description["fallback"] is False  # its configured runtime
    reason = description["reason"]
    assert reason is not None and reason.startswith("tensorrt failed while serving")
    assert ERROR in reason
    (event,) = rig.events
    assert event["reason"] == reason and event["fallback"] is False
    assert alert.message.endswith(
        "; no engine is rebuilt in the background: onnx_trt_ep is its configured runtime"
    )
    assert "may serve again" not in alert.message
    assert rig.builds == []


def test_a_tensorrt_model_that_fails_over_is_rebuilt_and_the_alert_says_so(
    rig_for: Any,
) -> None:
    """The usual case: configured ``tensorrt``; the alert says a build is asked for, and
    one is, after the alert (the failover's own news comes first)."""
    rig: Rig = rig_for("tensorrt")

    alert = rig.fail_over()

    assert rig.slot.is_fallback and rig.slot.fallback_cause == "execution"
    assert alert.message.endswith(
        "; a background build is asked for: a rebuilt, validated engine may serve again"
    )
    assert [build["model"] for build in rig.builds] == ["demo"]
    assert [alert.code for alert in rig.alerts] == [ALERT_CODE]


def test_a_tensorrt_model_whose_builds_are_spent_is_not_promised_one(rig_for: Any) -> None:
    """Configured ``tensorrt``, but ``rebuild_max_attempts`` builds were made this run:
    the failover's alert says no engine is rebuilt and why, then ``engine_build_gave_up``
    follows; no build.  Before: "a rebuilt, validated engine may serve again"."""
    rig: Rig = rig_for("tensorrt", max_attempts=1, attempts_spent=1)

    alert = rig.fail_over()

    assert alert.message.endswith(
        "; no engine is rebuilt in the background: 1 background build(s) in this run "
        "(runtime.rebuild_max_attempts)"
    )
    assert [alert.code for alert in rig.alerts] == [ALERT_CODE, "engine_build_gave_up"]
    assert rig.builds == []
