"""Refused runtime switches are recorded once per window (``serving/switching.py``):
an operator's script switching in a loop wrote one critical ``runtime_switch`` FDR
record per refusal (169 in 3 s), pushing the flight's history out of the
recorder's size cap.  The first refusal of a model for a reason is recorded at
once; the repeats within ``REFUSAL_WINDOW_S`` are counted and recorded as one
``runtime_switch_refusals`` record when the window ends, before the next one
recorded, or at ``stop``.  Each operator still gets the same refusal."""

from __future__ import annotations

import queue
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from inferd.config import ModelConfig, RuntimeConfig
from inferd.errors import InferdError
from inferd.fdr.kinds import validate
from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.serving.switching import REFUSAL_WINDOW_S, RuntimeSwitcher
from inferd.types import EngineHandle, Peer, TensorSpec, ThermalState
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, wait_until

SPEC = (TensorSpec("x", "float32", (1,)),)
NO_TENSORRT = "cannot prepare tensorrt: no tensorrt here; onnx_trt_ep keeps serving"


def answered_switch(
    switcher: RuntimeSwitcher, peer: Peer, model: str, label: str = "tensorrt"
) -> ProtocolError:
    """A ``runtime.switch`` of ``peer``: refused at once, or answered (refused by its
    preparation) with its thread done."""
    replies: queue.Queue[Any] = queue.Queue()
    header = {"model": model, "runtime": label, "requested_by": "script"}
    try:
        switcher.switch(header, peer, replies.put)
    except ProtocolError as refused:
        return refused
    reply = replies.get(timeout=HANG_S)
    wait_until(lambda: _switch_ended(switcher, model), message="the switch's thread done")
    assert isinstance(reply, ProtocolError), reply
    return reply


def _switch_ended(switcher: RuntimeSwitcher, model: str) -> bool:
    if not switcher.claim(model):
        return False
    switcher.unclaim(model)
    return True


class Rig:
    """One serving model whose switches are all refused, a clock the test moves,
    and the records the switcher writes."""

    def __init__(self, tmp_path: Path) -> None:
        self.now = 100.0
        self.records: list[tuple[str, dict[str, Any]]] = []
        slot = ModelSlot(ModelConfig(name="m", path=tmp_path / "m.onnx"))
        slot.handle = EngineHandle(1, "onnx_trt_ep", "0" * 64, SPEC, SPEC)
        slot.state = "serving"

        def prepare(label: str, *args: Any) -> tuple[Any, EngineHandle]:
            raise InferdError(f"no {label} here")

        slot.prepare = prepare  # type: ignore[method-assign]
        self.scheduler = Scheduler()
        self.scheduler.add_model("m", 4, "fifo")
        sinks = Sinks(
            alert=lambda alert: None,
            events=lambda topic, payload: None,
            record=self._record,
            thermal=ThermalState.unavailable,
        )
        runtime = RuntimeConfig(ort_trt_cache_dir=tmp_path / "ort", engine_dir=tmp_path / "e")
        self.switcher = RuntimeSwitcher(
            {"m": slot}, self.scheduler, runtime, sinks, clock=lambda: self.now
        )

    def _record(self, kind: str, payload: Mapping[str, Any]) -> None:
        validate(kind, payload)  # what the recorder would refuse
        self.records.append((kind, dict(payload)))

    def refuse(self, label: str = "tensorrt") -> ProtocolError:
        """An operator's runtime.switch, answered (refused) and its thread done."""
        return answered_switch(self.switcher, Peer.internal(0, 0), "m", label)

    def taken(self) -> list[tuple[str, Any]]:
        """The records written since the last call: (kind, outcome or count)."""
        taken = [(kind, p.get("outcome", p.get("count"))) for kind, p in self.records]
        self.records.clear()
        return taken


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def test_repeated_refusals_are_one_record_and_a_count_once_the_window_ends(rig: Rig) -> None:
    replies = [rig.refuse() for _ in range(5)]
    # The operator's reply is what it was: refused, its code and its reason.
    assert {(reply.code, reply.message) for reply in replies} == {
        (Code.FAILED_PRECONDITION, NO_TENSORRT)
    }
    (first,) = rig.records
    assert first[1]["reason"] == NO_TENSORRT and first[1]["requested_by"] == "script"
    assert rig.taken() == [("runtime_switch", "refused")]
    rig.now += REFUSAL_WINDOW_S - 0.1
    rig.switcher.flush_refusals()  # housekeeping, inside the window: nothing yet
    assert rig.taken() == []
    rig.now += 0.2
    rig.switcher.flush_refusals()  # the window ended: its count
    assert rig.records == [
        (
            "runtime_switch_refusals",
            {"model": "m", "reason": NO_TENSORRT, "count": 4, "window_s": REFUSAL_WINDOW_S},
        )
    ]
    rig.records.clear()
    rig.switcher.flush_refusals()  # reported once
    rig.refuse()  # a new window: recorded at once
    assert rig.taken() == [("runtime_switch", "refused")]


def test_the_count_is_recorded_before_the_next_refusal_recorded(rig: Rig) -> None:
    for _ in range(3):
        rig.refuse()
    rig.now += REFUSAL_WINDOW_S  # no housekeeping ran meanwhile
    rig.refuse()
    assert rig.taken() == [
        ("runtime_switch", "refused"),
        ("runtime_switch_refusals", 2),
        ("runtime_switch", "refused"),
    ]
    rig.switcher.flush_refusals(ended_only=False)
    assert rig.taken() == []  # nothing counted twice


def test_each_reason_is_recorded_on_its_own(rig: Rig) -> None:
    tensorrt = [rig.refuse("tensorrt") for _ in range(2)]
    onnx = [rig.refuse("onnx_trt_ep") for _ in range(2)]
    assert "no tensorrt here" in tensorrt[0].message and "no onnx_trt_ep here" in onnx[0].message
    assert [p["to_runtime"] for _, p in rig.records] == ["tensorrt", "onnx_trt_ep"]
    rig.records.clear()
    rig.now += REFUSAL_WINDOW_S
    rig.switcher.flush_refusals()
    assert sorted((p["reason"][:22], p["count"]) for _, p in rig.records) == [
        ("cannot prepare onnx_tr", 1),
        ("cannot prepare tensorr", 1),
    ]


def test_stop_records_what_its_window_still_counts(rig: Rig) -> None:
    for _ in range(3):
        rig.refuse()
    rig.switcher.stop()  # at shutdown, before the recorder stops
    assert rig.taken() == [("runtime_switch", "refused"), ("runtime_switch_refusals", 2)]
    rig.scheduler.close()
