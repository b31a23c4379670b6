"""An operator's switch of a ``tensorrt``-configured model to ``onnx_trt_ep`` is their
choice, not a fallback (review D, F4; the decision documented in docs/PROTOCOL.md, the
``model_runtime.fallback`` description of schemas/bus/common.json and
docs/OPERATIONS.md): ``fallback`` false, ``reason`` null and health not degraded by it,
while ``runtime`` differs from ``configured_runtime`` in status, health's ``runtime`` and
the ``runtime`` event, so an operator sees where it serves; no background build is asked
for it.  These pin the documented behaviour (the fix for F4 is the documents: no code
changed, so they passed before too)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from inferd.config import RuntimeConfig
from inferd.daemon import Daemon
from inferd.errors import EngineMissingError
from inferd.serving.model_report import READY, DaemonState, model_health, model_status
from inferd.serving.scheduler import Scheduler
from tests.unit.serving.test_review3_rebuild_causes import preparing
from tests.unit.serving.test_review_switch_rebuild import (  # noqa: F401  (the fixture)
    Rig,
    rig,
)

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas" / "bus"


def test_an_operators_switch_to_onnx_trt_ep_is_their_choice_not_a_fallback(
    rig: Rig,  # noqa: F811
) -> None:
    rig.slot.prepare = preparing(EngineMissingError("no engine"))  # type: ignore[method-assign]
    rig.slot.activate(RuntimeConfig(), rig.switcher._sinks)
    daemon = cast(Daemon, SimpleNamespace(rebuilder=rig.rebuilder))
    assert Daemon._rebuild_if_fallback(daemon, rig.slot) is None  # a build, as at start
    state = DaemonState()
    state.slots = {"m": rig.slot}
    state.state = READY
    assert (rig.slot.is_fallback, state.state) == (True, "degraded")  # fell back at start

    reply = rig.operator_switch("onnx_trt_ep")

    assert isinstance(reply, dict) and reply["to_runtime"] == "onnx_trt_ep"
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")
    status = model_status(rig.slot, scheduler)
    assert (status["configured_runtime"], status["runtime"]) == ("tensorrt", "onnx_trt_ep")
    assert (status["fallback"], status["reason"]) == (False, None)
    health = model_health(rig.slot, scheduler)
    assert (health["runtime"], health["fallback"]) == ("onnx_trt_ep", False)
    assert state.state == "serving"  # the operator's choice does not degrade the daemon
    assert Daemon._rebuild_if_fallback(daemon, rig.slot) == "it does not serve on the fallback"
    assert len(rig.builds) == 1  # the one asked for at start, none for the choice


def test_the_schemas_say_an_operators_choice_is_not_a_fallback() -> None:
    """The words the decision stands on (a reader of the schema is told the rule)."""
    common: dict[str, Any] = json.loads((SCHEMAS / "common.json").read_text())
    fallback = common["$defs"]["model_runtime"]["properties"]["fallback"]["description"]
    assert "runtime.switch" in fallback and "configured_runtime" in fallback
    infer: dict[str, Any] = json.loads((SCHEMAS / "infer_reply.json").read_text())
    text = json.dumps(infer)
    assert "runtime.switch" in text
