"""A request's ``max_reply_frame_bytes`` against an output of static shape is judged
before the run (DESIGN.md 248), also for a job admitted while its model loaded (or
checked against an engine a switch or failover has since replaced): the worker's
check against the engine that is to run it refuses it, as admission does while
the model serves, instead of running it for a reply it then cannot send."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from inferd.serving.engine_worker import EngineWorker
from inferd.serving.scheduler import Job, Scheduler
from inferd.types import EngineHandle
from tests.conftest import HANG_S
from tests.unit.serving.reply_queue import ReplyQueue
from tests.unit.serving.test_busy_poll import serving_slot
from tests.unit.serving.test_job_checked_engine import (
    RecordingRuntime,
    engine,
    job_checked_against,
)


def job_admitted_while_loading(request_id: int, x: np.ndarray, bound: int) -> Job:
    """A frames request as admission queues it while its model loads: described,
    not viewed, checked against no engine."""
    return job_checked_against(None, request_id, x, max_reply_frame_bytes=bound)


def run_jobs(handle: EngineHandle, jobs: list[Job]) -> tuple[list[dict[str, Any]], Any, Any]:
    """Each job's reply from a worker serving ``handle``; the runtime and the stats."""
    slot = serving_slot(0.0)
    runtime = RecordingRuntime()
    slot.runtime = runtime  # type: ignore[assignment]
    slot.handle = handle
    scheduler, port = Scheduler(), ReplyQueue()
    scheduler.add_model("m", 4, "fifo")
    worker = EngineWorker(port, scheduler, {"m": slot}, activate=lambda _slot: None)
    worker.start()
    replies = []
    try:
        assert worker.activated.wait(HANG_S)
        for job in jobs:
            scheduler.submit(job)
            replies.append(port.next_reply([str(job.request_id).encode()]))
    finally:
        scheduler.close()
        worker.join(HANG_S)
    return replies, runtime, slot.stats.snapshot()


def test_a_job_admitted_while_loading_is_refused_before_the_run_when_a_static_output_is_over() -> (
    None
):
    x = np.ones((1, 256), np.float32)  # y: (1, 256) float32, 1,024 bytes, static
    replies, runtime, stats = run_jobs(
        engine(1, (1, 256)),
        [job_admitted_while_loading(1, x, 1023), job_admitted_while_loading(2, x, 1024)],
    )
    refused, served = replies
    assert refused["error"]["code"] == "RESOURCE_EXHAUSTED", refused
    assert refused["error"]["message"] == (
        "output 'y' is 1024 bytes, over this request's max_reply_frame_bytes = 1023; "
        "the request was not run"
    )
    assert served["ok"] is True, served
    assert runtime.shapes == [(1, 256)]  # the refused one never ran
    assert stats["responses"] == {"RESOURCE_EXHAUSTED": 1, "OK": 1}  # each counted once


def test_a_job_checked_against_a_replaced_engine_is_judged_on_the_new_ones_outputs() -> None:
    x = np.ones((1, 4), np.float32)
    admitted_on = engine(1, (None, 4))  # dynamic at admission: left to the run
    job = dataclasses.replace(job_checked_against(admitted_on, 1, x), max_reply_frame_bytes=15)
    replies, runtime, _ = run_jobs(engine(2, (1, 4)), [job])  # static now: 16 bytes
    assert replies[0]["error"]["code"] == "RESOURCE_EXHAUSTED", replies[0]
    assert replies[0]["error"]["message"].endswith("the request was not run")
    assert runtime.shapes == []
