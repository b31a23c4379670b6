"""The engine worker declares each model load (what, and the model's max_load_s)
before it starts it, and ends it with a beat: the watchdog's view of a worker that
cannot beat because it is loading an engine."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferd.config import ModelConfig
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot
from inferd.supervision.watchdog import assess
from tests.conftest import HANG_S
from tests.unit.serving.reply_queue import ReplyQueue


def test_a_model_load_is_declared_with_its_bound_and_ends_with_a_beat() -> None:
    models = [
        ModelConfig(name="det", path=Path("det.onnx"), runtime="tensorrt", max_load_s=900.0),
        ModelConfig(name="seg", path=Path("seg.onnx"), max_load_s=30.0),
    ]
    slots = {model.name: ModelSlot(model) for model in models}
    scheduler = Scheduler()
    for model in models:
        scheduler.add_model(model.name, 4, "fifo")
    entered = {name: threading.Event() for name in slots}
    release = {name: threading.Event() for name in slots}

    def activate(slot: ModelSlot) -> None:
        entered[slot.name].set()
        assert release[slot.name].wait(HANG_S)
        slot.state = "failed"

    worker = EngineWorker(ReplyQueue(), scheduler, slots, activate=activate)
    try:
        worker.start()
        for name, runtime, allowed_s in (("det", "tensorrt", 900.0), ("seg", "onnx_trt_ep", 30.0)):
            assert entered[name].wait(HANG_S)
            busy = worker.liveness().busy
            assert busy is not None
            assert (busy.what, busy.allowed_s) == (f"loading {name} ({runtime})", allowed_s)
            # However long it has been silent, a thread within its bound is waited for.
            later = busy.started_ns + int((allowed_s - 1) * 1e9)
            stalls, waiting = assess({"engine_worker": worker.liveness()}, later, 1.5)
            assert stalls == {} and waiting == {"engine_worker": busy}
            stalls, _ = assess(
                {"engine_worker": worker.liveness()},
                busy.started_ns + int((allowed_s + 1) * 1e9),
                1.5,
            )
            assert stalls["engine_worker"].reason == "overran"
            before = time.monotonic_ns()
            release[name].set()
        assert worker.activated.wait(HANG_S)
        state = worker.liveness()
        assert state.busy is None and state.beat_ns is not None and state.beat_ns >= before
    finally:
        for event in release.values():
            event.set()
        scheduler.close()
        worker.join(HANG_S)
    assert worker.liveness().beat_ns is None  # a worker that is gone reads as not running


class RefusalFlood:
    """``serving.engine_worker.RequestPort`` with one source that keeps a stream of
    ``messages`` waiting, each answered at once and queueing no job (a refusal, an
    unregister): the worker reads them all without going back to its loop."""

    def __init__(self, messages: int) -> None:
        self.source = os.eventfd(1, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.listen_fds = (self.source,)
        self.left = messages
        self.first_ns = 0
        self.read_beat: Callable[[], int | None] = lambda: None
        self.beat_at_last: int | None = None
        self.done = threading.Event()

    def worker_listening(self, listening: bool, last_run_ns: int = 0) -> None:
        pass

    def serve_one(self, ready: list[int]) -> bool:
        if self.source not in ready or self.left == 0:
            return False
        if not self.first_ns:
            self.first_ns = time.monotonic_ns()
        self.left -= 1
        if self.left == 0:
            self.beat_at_last = self.read_beat()
            os.eventfd_read(self.source)  # nothing waits any more
            self.done.set()
        return True

    def send_reply(self, parts: list[Any]) -> None:
        raise AssertionError("a refusal flood queues no job")


def test_a_stream_of_messages_that_queue_no_job_keeps_the_worker_beating() -> None:
    """Each message the worker reads is a beat: a client that floods it with
    refusals must not make it look stalled to the watchdog (which withholds its
    pings: systemd would kill the daemon)."""
    port, scheduler = RefusalFlood(messages=2000), Scheduler()
    worker = EngineWorker(port, scheduler, {}, activate=lambda slot: None)
    port.read_beat = lambda: worker.liveness().beat_ns
    worker.start()
    try:
        assert port.done.wait(HANG_S)
        assert port.beat_at_last is not None and port.beat_at_last > port.first_ns
    finally:
        scheduler.close()
        worker.join(HANG_S)
        os.close(port.source)
