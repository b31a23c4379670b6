"""``runtime.switch`` is rate limited per verified peer (``serving/switching.py``,
``inferd.peer_rate_limit``): each switch prepares a runtime, and an operator's
script switching in a loop made the daemon prepare one after another (96 ONNX
Runtime sessions in 5 s on this CPU, each with its ``provider_degraded`` and
``runtime_switch`` records).  ``runtime.switch_burst`` at once, then one every
``runtime.switch_refill_s``; past it ``RESOURCE_EXHAUSTED`` saying when to retry,
nothing prepared.  As for ``build.start``, only a switch about to prepare takes a
token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inferd.config import ModelConfig, RuntimeConfig
from inferd.errors import InferdError
from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.serving.switching import RuntimeSwitcher
from inferd.types import EngineHandle, Peer, TensorSpec, ThermalState
from inferd_wire.protocol import Code, ProtocolError
from tests.unit.serving.test_switch_refusals import answered_switch

SPEC = (TensorSpec("x", "float32", (1,)),)
ALICE = Peer("ipc", uid=1001, gid=1001, pid=5, user="alice", operator=True)
BOB = Peer("ipc", uid=1002, gid=1002, pid=6, user="bob", operator=True)


class Rig:
    """One serving model whose preparations are counted (and fail, so that nothing
    swaps), a clock the test moves, and the records the switcher writes."""

    def __init__(self, tmp_path: Path) -> None:
        self.now = 100.0
        self.prepared = 0
        self.records: list[str] = []
        slot = ModelSlot(ModelConfig(name="m", path=tmp_path / "m.onnx"))
        slot.handle = EngineHandle(1, "onnx_trt_ep", "0" * 64, SPEC, SPEC)
        slot.state = "serving"
        slot.prepare = self._prepare  # type: ignore[method-assign]
        self.scheduler = Scheduler()
        self.scheduler.add_model("m", 4, "fifo")
        sinks = Sinks(
            alert=lambda alert: None,
            events=lambda topic, payload: None,
            record=lambda kind, payload: self.records.append(kind),
            thermal=ThermalState.unavailable,
        )
        runtime = RuntimeConfig(
            ort_trt_cache_dir=tmp_path / "ort",
            engine_dir=tmp_path / "e",
            switch_burst=2,
            switch_refill_s=10.0,
        )
        self.switcher = RuntimeSwitcher(
            {"m": slot}, self.scheduler, runtime, sinks, clock=lambda: self.now
        )

    def _prepare(self, label: str, *args: Any) -> tuple[Any, EngineHandle]:
        self.prepared += 1
        raise InferdError(f"no {label} here")

    def switch(self, peer: Peer, model: str = "m") -> ProtocolError:
        """A ``runtime.switch`` of ``peer``: refused at once, or prepared (and refused
        by the preparation) with its thread done."""
        return answered_switch(self.switcher, peer, model)


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def test_a_peer_past_its_burst_is_refused_until_a_token_refills(rig: Rig) -> None:
    assert [rig.switch(ALICE).code for _ in range(2)] == [Code.FAILED_PRECONDITION] * 2
    assert rig.prepared == 2
    records = list(rig.records)
    limited = rig.switch(ALICE)
    assert limited.code is Code.RESOURCE_EXHAUSTED
    assert limited.message == (
        "runtime.switch rate limit for uid 1001 (alice) pid 5: 2 at once, then one every "
        "10 s (runtime.switch_burst, runtime.switch_refill_s); retry after 10.0 s"
    )
    # Nothing prepared, nothing recorded: the refusal is counted in status instead.
    assert rig.prepared == 2 and rig.records == records
    assert rig.switcher.rate.describe() == {"burst": 2, "refill_s": 10.0, "refused": 1}
    assert rig.switch(BOB).code is Code.FAILED_PRECONDITION  # another peer keeps its share
    rig.now += 4.0
    assert "retry after 6.0 s" in rig.switch(ALICE).message
    rig.now += 6.0
    assert rig.switch(ALICE).code is Code.FAILED_PRECONDITION
    assert rig.prepared == 4 and rig.switcher.rate.refused == 2


def test_a_switch_refused_before_preparing_costs_no_token(rig: Rig) -> None:
    for _ in range(5):
        assert rig.switch(ALICE, model="nope").code is Code.NOT_FOUND
    assert rig.switcher.claim("m")  # a switch of m in progress (a failover's, here)
    for _ in range(5):
        assert rig.switch(ALICE).code is Code.FAILED_PRECONDITION
    rig.switcher.unclaim("m")
    assert rig.prepared == 0
    assert [rig.switch(ALICE).code for _ in range(2)] == [Code.FAILED_PRECONDITION] * 2
    assert rig.prepared == 2 and rig.switcher.rate.refused == 0


def test_the_daemons_own_switches_are_not_counted(rig: Rig) -> None:
    for _ in range(4):
        assert rig.switch(Peer.internal(0, 1)).code is Code.FAILED_PRECONDITION
    assert rig.prepared == 4
    assert rig.switch(ALICE).code is Code.FAILED_PRECONDITION  # its burst is whole


def test_a_switch_whose_thread_never_started_gives_its_token_back(rig: Rig) -> None:
    rig.switcher.stop()  # shutting down: no switch starts
    for _ in range(3):
        assert rig.switch(ALICE).code is Code.UNAVAILABLE
    assert rig.prepared == 0 and rig.switcher.rate.retry_after(ALICE.key) is None
    rig.scheduler.close()
