"""A request queued while its model loaded is validated by the engine worker once
the model serves: a placed output that cannot be viewed (no element, but other
dimensions past what an array may span) ended the worker with ``ValueError``,
and with it the daemon (DESIGN.md 126).  It is answered ``INVALID_ARGUMENT``
and the worker goes on."""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path
from typing import Any

import numpy as np

from inferd.bus.region_refs import bind_regions
from inferd.config import ShmConfig
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.scheduler import Job, Scheduler
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd.types import EngineHandle, TensorSpec
from tests.conftest import HANG_S
from tests.unit.bus.test_codec_regions import descriptor, request
from tests.unit.bus.test_shm_requests import sealed_memfd
from tests.unit.serving.reply_queue import ReplyQueue
from tests.unit.serving.test_busy_poll import serving_slot


def test_a_late_validated_output_too_wide_to_view_is_refused_and_the_worker_goes_on() -> None:
    table = RegionTable(ShmConfig(socket=Path("/run/inferd/shm.sock")))
    fd = sealed_memfd()
    region = table.register(Connection(1, PeerCredentials(1, os.getuid(), 0)), fd, None)
    os.close(fd)
    slot = serving_slot(0.0)
    # Served with dynamic output dimensions: the spec lets any such shape through.
    slot.handle = EngineHandle(
        1,
        "onnx_trt_ep",
        "0" * 64,
        (TensorSpec("x", "float32", (None, 4)),),
        (TensorSpec("y", "float32", (None, None, None)),),
    )
    output = {**descriptor(region, 0, (0, 2**31 - 1, 2**31 - 1)), "name": "y"}
    header = {"v": 1, "id": 1, "op": "infer", "model": "m", "outputs": [output]}
    header["inputs"] = [descriptor(region, 256, (2, 4))]
    regions = bind_regions(request(header), table)
    deaths: queue.Queue[tuple[BaseException, Job | None]] = queue.Queue()
    scheduler, port = Scheduler(), ReplyQueue()
    scheduler.add_model("m", 4, "fifo")
    worker = EngineWorker(
        port,
        scheduler,
        {"m": slot},
        activate=lambda _slot: None,
        on_died=lambda exc, job: deaths.put((exc, job)),
    )
    worker.start()
    try:
        assert worker.activated.wait(HANG_S)
        # As admitted while the model loaded: no inputs yet, validated by the worker.
        described = [("x", "float32", np.dtype(np.float32), (2, 4))]  # as parsed at admission
        late = Job([b"a"], 1, "m", None, time.monotonic_ns(), None, [], described, regions=regions)
        scheduler.submit(late)
        reply = port.next_reply([b"a"])
        assert reply["error"]["code"] == "INVALID_ARGUMENT", reply
        assert "output 'y'" in reply["error"]["message"]
        # The worker still serves the next request.
        scheduler.submit(Job([b"b"], 2, "m", {"x": np.zeros(1, np.float32)}, 0, None))
        assert port.next_reply([b"b"])["ok"] is True
        assert deaths.empty() and worker.is_alive()
    finally:
        scheduler.close()
        worker.join(HANG_S)
        table.close_all()
    snapshot: dict[str, Any] = slot.stats.snapshot()
    assert snapshot["responses"] == {"INVALID_ARGUMENT": 1, "OK": 1}
