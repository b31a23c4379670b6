"""A request whose reply the engine worker made but could not send is counted once,
as what it is answered: the worker's death hands it to ``on_died``, which answers it
``INTERNAL`` (``RequestRouter.fail``, as ``Daemon._worker_died`` does).  Before, its
first answer had been counted already, so the model counted it twice (``OK`` and
``INTERNAL``): more answers than requests in ``status`` and the metrics."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from inferd.serving.engine_worker import EngineWorker
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.stats import ModelStats
from inferd_wire.protocol import Code
from tests.conftest import HANG_S
from tests.unit.serving.test_busy_poll import serving_slot
from tests.unit.serving.test_worker_death import BrokenSend


@pytest.mark.parametrize("answer", ["OK", "DEADLINE_EXCEEDED"])
def test_a_reply_whose_send_raised_is_counted_once_as_what_it_is_answered(answer: str) -> None:
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")
    slot = serving_slot(0.0)
    router = RequestRouter({"m": slot}, scheduler, {})
    died = threading.Event()

    def on_died(exc: BaseException, in_hand: Job | None) -> None:  # as the daemon's
        assert in_hand is not None
        router.fail([in_hand], Code.INTERNAL, f"the engine worker stopped on {exc}")
        died.set()

    worker = EngineWorker(
        BrokenSend(), scheduler, {"m": slot}, activate=lambda _slot: None, on_died=on_died
    )
    worker.start()
    assert worker.activated.wait(HANG_S)
    now = time.monotonic_ns()
    deadline = now - 1 if answer == "DEADLINE_EXCEEDED" else None
    slot.stats.received()  # as admission does
    scheduler.submit(Job([b"client"], 1, "m", {"x": np.zeros(1, np.float32)}, now, deadline))
    assert died.wait(HANG_S)
    worker.join(HANG_S)
    scheduler.close()
    snapshot = slot.stats.snapshot()
    assert (snapshot["requests"], snapshot["responses"]) == (1, {"INTERNAL": 1}), snapshot
    assert snapshot["errors"] == 1 and snapshot["latency_us"] == {"window": 0}
    assert slot.stats.latency_histogram().count == 0  # no OK reply left


def test_a_retracted_answer_leaves_the_stats_as_before_it() -> None:
    stats = ModelStats()
    stats.answered("OK", 700)
    before = (stats.snapshot(), stats.latency_histogram())
    stats.answered("OK", 1500, late=True)
    stats.retract("OK", 1500, late=True)
    stats.answered("INTERNAL")
    stats.retract("INTERNAL")
    assert (stats.snapshot(), stats.latency_histogram()) == before
