"""Phase-tree events (``inferd.engine_build.progress``, with ``.events``): the
progress-monitor adapter, queue, tree, stall watchdog, and the same adapter
behind TensorRT's ``IProgressMonitor`` (fake TensorRT)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from inferd.engine_build import (
    CancellationToken,
    EventQueue,
    PhaseTree,
    ProgressAdapter,
    StallWatchdog,
    make_trt_progress_monitor,
)
from inferd.engine_build.events import render_snapshot
from inferd.engine_build.tensorrt_builder import TensorRTBuilder
from inferd.types import BuildConfig
from tests.conftest import wait_until
from tests.fakes import fake_tensorrt


def adapter(queue: EventQueue | None = None) -> ProgressAdapter:
    return ProgressAdapter("b1", CancellationToken(), queue=queue)


def test_callbacks_become_events_with_ids_parents_and_timestamps() -> None:
    a = adapter()
    a.phase_start("Building engine", None, 2)
    a.phase_start("Tactic selection", "Building engine", 3)
    assert a.step_complete("Tactic selection", 0) is True
    a.phase_finish("Tactic selection")
    a.phase_finish("Building engine")
    events = a.queue.drain()
    assert [e.type for e in events] == [
        "phase_start",
        "phase_start",
        "step",
        "phase_finish",
        "phase_finish",
    ]
    top, child = events[0], events[1]
    assert (top.phase_id, top.parent_id) == ("p1", None)
    assert (child.phase_id, child.parent_id, child.num_steps) == ("p2", "p1", 3)
    assert events[2].phase_id == "p2" and events[2].step == 0
    assert all(e.build_id == "b1" and e.cancel_state == "none" for e in events)
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert all(e.mono_ns > 0 and e.wall_ns > 0 and e.thread for e in events)
    tree = PhaseTree.from_events(events)
    snap = tree.snapshot()
    assert snap["roots"][0]["name"] == "Building engine"
    # Both phases finished before all their steps: normal, not an error.
    assert snap["roots"][0]["status"] == "finished_early"
    assert snap["roots"][0]["children"][0]["completedSteps"] == 1
    assert "Tactic selection [finished_early 1/3]" in tree.render()
    assert render_snapshot(snap) == tree.render()


def test_a_reused_phase_name_gets_a_new_stable_id() -> None:
    a = adapter()
    for _ in range(2):
        a.phase_start("Timing", None, 1)
        a.step_complete("Timing", 0)
        a.phase_finish("Timing")
    starts = [e for e in a.queue.drain() if e.type == "phase_start"]
    assert [e.phase_id for e in starts] == ["p1", "p2"]
    assert a.tree.snapshot()["roots"][0]["status"] == "finished"


def test_snapshot_at_any_time_shows_the_active_path() -> None:
    a = adapter()
    a.phase_start("Building engine", None, 2)
    a.phase_start("Tactic selection", "Building engine", 2)
    a.phase_start("Timing node conv", "Tactic selection", 4)
    assert a.active_path() == ["Building engine", "Tactic selection", "Timing node conv"]
    assert a.snapshot()["state"] == "running"


def test_full_queue_drops_and_counts_never_blocks() -> None:
    a = adapter(EventQueue(maxsize=3))
    a.phase_start("x", None, 100)
    started = time.monotonic()
    for step in range(99):
        assert a.step_complete("x", step) is True
    assert time.monotonic() - started < 1.0
    assert len(a.queue) == 3 and a.queue.dropped == 97
    # The adapter's own tree still has everything.
    assert a.snapshot()["roots"][0]["completedSteps"] == 99
    assert a.snapshot()["droppedEvents"] == 97


def test_step_complete_returns_false_once_cancelled_and_event_records_it() -> None:
    a = adapter()
    a.phase_start("x", None, 3)
    assert a.step_complete("x", 0) is True
    a.token.cancel("control")
    assert a.step_complete("x", 1) is False
    events = a.queue.drain()
    assert events[-2].type == "cancel_requested"
    assert events[-2].detail["source"] == "control"
    assert events[-1].cancel_state == "requested"
    assert a.first_false_ns is not None


def test_callbacks_never_raise_into_the_builder() -> None:
    def boom(_event: Any) -> None:
        raise RuntimeError("consumer bug")

    a = ProgressAdapter("b", CancellationToken(), listener=boom)
    a.phase_start("x", None, 1)
    assert a.step_complete("x", 0) is True
    a.phase_finish("never started")
    assert a.callback_errors == 3 and a.unknown_finishes == 1


def test_callbacks_from_many_threads_are_thread_safe() -> None:
    a = adapter(EventQueue(maxsize=100_000))
    a.phase_start("Tactic selection", None, 8)

    def worker(index: int) -> None:
        name = f"Timing node {index}"
        a.phase_start(name, "Tactic selection", 200)
        for step in range(200):
            a.step_complete(name, step)
        a.phase_finish(name)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events = a.queue.drain()
    assert len(events) == 1 + 8 * 202
    assert len({e.seq for e in events}) == len(events)
    tree = PhaseTree.from_events(sorted(events, key=lambda e: e.seq))
    children = tree.snapshot()["roots"][0]["children"]
    assert len(children) == 8 and all(c["status"] == "finished" for c in children)
    assert len({e.thread for e in events}) >= 2


def test_stall_watchdog_reports_path_depth_with_backoff_and_never_cancels() -> None:
    a = adapter()
    a.phase_start("Building engine", None, 1)
    a.phase_start("Tactic selection", "Building engine", 1)
    dog = StallWatchdog(a, 0.05).start()
    wait_until(lambda: len(dog.stalls) >= 3, message="three stalls")
    dog.stop()
    stalls = [e for e in a.queue.drain() if e.type == "stalled"]
    assert len(stalls) == len(dog.stalls) >= 3
    assert stalls[0].detail["path"] == ["Building engine", "Tactic selection"]
    assert stalls[0].detail["depth"] == 2
    # Back-off: the n-th report waits 0.05 * 2**n s more (at 0.05, 0.15, 0.35 s idle),
    # never sooner; a watchdog without back-off would report at 0.05, 0.10, 0.15 s.
    for stall, (idle_s, next_after_s) in zip(
        stalls, [(0.05, 0.1), (0.15, 0.2), (0.35, 0.4)], strict=False
    ):
        assert stall.detail["idleS"] >= idle_s
        assert stall.detail["nextAfterS"] == next_after_s
    assert stalls[1].detail["idleS"] >= 2 * stalls[0].detail["idleS"]
    assert not a.token.is_set()


def test_stall_watchdog_cancels_only_when_configured() -> None:
    a = adapter()
    a.phase_start("x", None, 1)
    dog = StallWatchdog(a, 0.03, cancel_after_stalls=1).start()
    wait_until(a.token.is_set, message="the stall cancelling")
    dog.stop()
    assert a.token.source == "stall"


# -- the same adapter behind trt.IProgressMonitor -------------------------------------------


def test_trt_monitor_subclass_forwards_to_the_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    stack = fake_tensorrt.install(monkeypatch)
    trt = stack.tensorrt
    a = adapter()
    monitor = make_trt_progress_monitor(a, trt)
    assert isinstance(monitor, trt.IProgressMonitor)
    monitor.phase_start("Building engine", None, 1)
    assert monitor.step_complete("Building engine", 0) is True
    monitor.phase_finish("Building engine")
    assert [e.type for e in a.queue.drain()] == ["phase_start", "step", "phase_finish"]


@pytest.fixture
def builder(monkeypatch: pytest.MonkeyPatch, demo_model: Path) -> TensorRTBuilder:
    stack = fake_tensorrt.install(monkeypatch)
    return TensorRTBuilder(stack.tensorrt, stack.driver, demo_model, BuildConfig())


def test_the_tensorrt_builder_drives_the_adapter(builder: TensorRTBuilder) -> None:
    a = adapter()
    output = builder.build(a, None)
    assert output.engine is not None and output.error is None
    tree = a.snapshot()
    assert tree["roots"][0]["name"] == "Building engine"
    assert tree["roots"][0]["children"][0]["name"] == "Timing graph nodes"
    assert tree["roots"][0]["status"] == "finished"


def test_the_tensorrt_builder_is_cancelled_through_the_token(builder: TensorRTBuilder) -> None:
    token = CancellationToken()
    a = ProgressAdapter("b", token)

    def cancel_at_first_node(event: Any) -> None:
        if event.type == "step" and event.name == "Timing graph nodes":
            token.cancel("control")

    a.listener = cancel_at_first_node
    output = builder.build(a, None)
    assert output.engine is None  # build_serialized_network returned None
    snap = a.snapshot()
    assert snap["state"] == "cancel_requested"
    assert snap["roots"][0]["status"] == "finished_early"
