"""An exception that ends the engine worker is handed to ``on_died`` with the job
it was answering (the daemon answers that one and every queued request, then
exits for systemd to restart it: ``tests/integration/test_worker_death.py``)."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

import numpy as np

from inferd.config import ModelConfig
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot
from tests.conftest import HANG_S
from tests.unit.serving.reply_queue import ReplyQueue
from tests.unit.serving.test_busy_poll import serving_slot


class Deaths:
    """``on_died``: what it was told, in order."""

    def __init__(self) -> None:
        self.told: queue.Queue[tuple[BaseException, Job | None]] = queue.Queue()

    def __call__(self, exc: BaseException, in_hand: Job | None) -> None:
        self.told.put((exc, in_hand))


def test_an_activation_that_raises_is_told_with_no_job_and_start_up_ends() -> None:
    slots = {"m": ModelSlot(ModelConfig(name="m", path=Path("m.onnx")))}
    scheduler, deaths = Scheduler(), Deaths()

    def activate(slot: ModelSlot) -> None:
        raise RuntimeError("not a refusal the runtime knows")

    worker = EngineWorker(ReplyQueue(), scheduler, slots, activate=activate, on_died=deaths)
    worker.start()
    worker.join(HANG_S)
    assert not worker.is_alive()
    exc, in_hand = deaths.told.get(timeout=HANG_S)
    assert isinstance(exc, RuntimeError) and in_hand is None
    assert worker.activated.is_set()  # start-up does not wait for it
    assert slots["m"].state == "released"


class BrokenSend(ReplyQueue):
    """A port whose send raises: the reply never leaves."""

    def send_reply(self, parts: list[Any]) -> None:
        raise RuntimeError("the send broke")


def test_a_job_whose_answer_raises_is_handed_over_unanswered() -> None:
    scheduler, deaths = Scheduler(), Deaths()
    scheduler.add_model("m", 4, "fifo")
    worker = EngineWorker(
        BrokenSend(),
        scheduler,
        {"m": serving_slot(0.0)},
        activate=lambda slot: None,
        on_died=deaths,
    )
    worker.start()
    assert worker.activated.wait(HANG_S)
    job = Job([b"client"], 1, "m", {"x": np.zeros(1, np.float32)}, time.monotonic_ns(), None)
    scheduler.submit(job)
    exc, in_hand = deaths.told.get(timeout=HANG_S)
    assert str(exc) == "the send broke" and in_hand is job
    worker.join(HANG_S)
    assert not worker.is_alive()
    scheduler.close()
