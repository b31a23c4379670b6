"""An operator's runtime switch that does not happen is never made later
(``serving/switching.py``, DESIGN.md 127): one the worker does not take in time is
given up (INTERNAL) and its queued swap does nothing when the worker gets to it; at
shutdown ``stop`` answers every switch the worker has not taken UNAVAILABLE, and
its prepared engine is released once its preparation ends.

No engine worker runs here: the test takes the queued swap from the scheduler and
runs it itself, as the worker would between two requests."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from inferd.config import ModelConfig, RuntimeConfig
from inferd.serving import switching
from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.serving.switching import RuntimeSwitcher
from inferd.types import EngineHandle, Peer, TensorSpec, ThermalState
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, wait_until

SPEC = (TensorSpec("x", "float32", (1,)),)


@dataclass
class Released:
    """A runtime as the switch uses it: what it released, in order."""

    handles: list[int] = field(default_factory=list)

    def release_engine(self, handle: EngineHandle) -> None:
        self.handles.append(handle.handle_id)


@dataclass
class Rig:
    slot: ModelSlot
    scheduler: Scheduler
    switcher: RuntimeSwitcher
    new_runtime: Released
    #: Set to let the preparation of the new engine end.
    prepared: threading.Event
    replies: queue.Queue[dict[str, Any] | ProtocolError] = field(default_factory=queue.Queue)

    def switch(self) -> None:
        header = {"model": "m", "runtime": "tensorrt", "requested_by": "test"}
        self.switcher.switch(header, Peer.internal(0, 0), self.replies.put)

    def take_swap(self) -> Callable[[], None]:
        """The swap the switch queued for the worker (waiting for it to be queued)."""
        calls: list[Any] = []

        def queued() -> bool:
            call = self.scheduler.take(timeout=0)
            if call is not None:
                calls.append(call)
            return bool(calls)

        wait_until(queued, HANG_S, message="the swap queued for the worker")
        assert callable(calls[0])
        return calls[0]  # type: ignore[no-any-return]


def handle(handle_id: int, label: str) -> EngineHandle:
    return EngineHandle(handle_id, label, "0" * 64, SPEC, SPEC)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    slot = ModelSlot(ModelConfig(name="m", path=tmp_path / "m.onnx"))
    slot.runtime = Released()  # type: ignore[assignment]
    slot.handle = handle(1, "onnx_trt_ep")
    slot.state = "serving"
    new_runtime, prepared = Released(), threading.Event()

    def prepare(label: str, *args: Any) -> tuple[Any, EngineHandle]:
        assert prepared.wait(HANG_S)
        return new_runtime, handle(2, label)

    slot.prepare = prepare  # type: ignore[method-assign]
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")
    sinks = Sinks(
        alert=lambda alert: None,
        events=lambda topic, payload: None,
        record=lambda kind, payload: None,
        thermal=ThermalState.unavailable,
    )
    config = RuntimeConfig(ort_trt_cache_dir=tmp_path / "ort", engine_dir=tmp_path / "engines")
    switcher = RuntimeSwitcher({"m": slot}, scheduler, config, sinks)
    yield Rig(slot, scheduler, switcher, new_runtime, prepared)
    prepared.set()
    scheduler.close()


def refusal(reply: object) -> Code:
    assert isinstance(reply, ProtocolError), reply
    return reply.code


def test_a_swap_the_worker_does_not_take_in_time_is_given_up_and_never_made(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(switching, "_SWAP_TIMEOUT_S", 0.05)  # the bound under test
    rig.prepared.set()
    rig.switch()
    swap = rig.take_swap()
    reply = rig.replies.get(timeout=HANG_S)
    assert refusal(reply) == Code.INTERNAL and "keeps serving" in str(reply)
    assert rig.new_runtime.handles == [2]  # the prepared engine was released
    swap()  # the worker gets to it at last
    assert rig.slot.handle is not None and rig.slot.handle.handle_id == 1
    assert rig.new_runtime.handles == [2]
    assert rig.switcher.claim("m")  # and the model may be switched again


def test_stop_answers_a_switch_still_preparing_and_it_never_happens(rig: Rig) -> None:
    rig.switch()
    stopping = threading.Thread(target=rig.switcher.stop)
    stopping.start()
    # Told while the engine still loads; stop then waits for the preparation.
    assert refusal(rig.replies.get(timeout=HANG_S)) == Code.UNAVAILABLE
    assert stopping.is_alive()
    rig.prepared.set()
    stopping.join(HANG_S)
    assert not stopping.is_alive()
    assert rig.new_runtime.handles == [2]  # released before stop returned
    assert rig.scheduler.take(timeout=0) is None  # nothing was queued for the worker
    assert rig.slot.handle is not None and rig.slot.handle.handle_id == 1
    assert rig.replies.empty()  # told once


def test_stop_answers_a_switch_whose_swap_waits_and_the_swap_does_nothing(rig: Rig) -> None:
    rig.prepared.set()
    rig.switch()
    swap = rig.take_swap()
    rig.switcher.stop()
    assert refusal(rig.replies.get(timeout=HANG_S)) == Code.UNAVAILABLE
    wait_until(lambda: rig.new_runtime.handles == [2], HANG_S, message="engine released")
    swap()
    assert rig.slot.handle is not None and rig.slot.handle.handle_id == 1
    assert rig.replies.empty()


def test_stop_waits_for_a_swap_the_worker_took_and_its_reply_is_the_switch(rig: Rig) -> None:
    in_swap, finish = threading.Event(), threading.Event()
    swap_engines = rig.slot.swap

    def slow_swap(*args: Any) -> Any:
        in_swap.set()
        assert finish.wait(HANG_S)
        return swap_engines(*args)

    rig.slot.swap = slow_swap  # type: ignore[method-assign]
    rig.prepared.set()
    rig.switch()
    worker = threading.Thread(target=rig.take_swap())
    worker.start()
    assert in_swap.wait(HANG_S)  # the worker has taken it
    stopping = threading.Thread(target=rig.switcher.stop)
    stopping.start()
    finish.set()
    stopping.join(HANG_S)
    worker.join(HANG_S)
    reply = rig.replies.get_nowait()  # there when stop returned: it waited for it
    assert isinstance(reply, dict) and reply["to_runtime"] == "tensorrt"
    assert rig.slot.handle is not None and rig.slot.handle.handle_id == 2
    assert rig.new_runtime.handles == []


def test_after_stop_a_new_switch_is_refused_at_once(rig: Rig) -> None:
    rig.switcher.stop()
    with pytest.raises(ProtocolError) as refused:
        rig.switch()
    assert refused.value.code == Code.UNAVAILABLE
    assert rig.switcher.claim("m")  # the refusal claimed nothing


def test_stop_gives_up_and_waits_for_the_daemons_own_switch_too(rig: Rig) -> None:
    """A rebuilt engine being adopted (``switch_now``, on a build's thread) when the
    daemon stops: given up like an operator's switch, and waited for."""
    outcome: list[object] = []

    def adopt() -> None:
        try:
            outcome.append(rig.switcher.switch_now("m", "tensorrt", "inferd: build b1"))
        except ProtocolError as exc:
            outcome.append(exc)

    adopting = threading.Thread(target=adopt)
    adopting.start()
    wait_until(lambda: "m" in rig.switcher._in_progress, HANG_S, message="the switch began")
    stopping = threading.Thread(target=rig.switcher.stop)
    stopping.start()
    wait_until(lambda: rig.switcher._preparers.stopping, HANG_S, message="stop began")
    assert stopping.is_alive()  # waiting for the switch still preparing
    rig.prepared.set()
    stopping.join(HANG_S)
    adopting.join(HANG_S)
    assert not stopping.is_alive() and not adopting.is_alive()
    assert refusal(outcome[0]) == Code.UNAVAILABLE
    assert rig.new_runtime.handles == [2]
    assert rig.slot.handle is not None and rig.slot.handle.handle_id == 1


def test_a_switch_while_the_daemon_still_loads_models_is_refused_at_once(rig: Rig) -> None:
    """The engine worker loads every model before it takes any swap: a switch of a
    model that already serves while another still loads was refused INTERNAL after
    60 s (the swap never taken).  Now UNAVAILABLE at once, nothing claimed, and the
    same switch goes through once the models are loaded."""
    loaded = threading.Event()
    rig.switcher._ready = loaded.is_set  # as Daemon wires it: the worker's `activated`
    with pytest.raises(ProtocolError) as refused:
        rig.switch()
    assert refused.value.code == Code.UNAVAILABLE
    assert "still loading" in refused.value.message
    assert rig.switcher.claim("m")  # the refusal claimed nothing
    rig.switcher.unclaim("m")
    loaded.set()
    rig.switch()
    rig.prepared.set()
    rig.take_swap()()
    reply = rig.replies.get(timeout=HANG_S)
    assert isinstance(reply, dict) and reply["to_runtime"] == "tensorrt"
    assert rig.slot.handle is not None and rig.slot.handle.handle_id == 2
