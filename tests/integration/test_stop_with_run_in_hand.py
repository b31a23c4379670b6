"""A run that outlives the stop's wait for the engine worker (a TensorRT call that
hangs, a GPU gone): its request is answered ``UNAVAILABLE`` before the sockets
close, not left to the client's timeout, and only once (the worker's own reply,
should the run end later, is dropped).

The hang is injected: a ``sitecustomize`` on the daemon's ``PYTHONPATH`` makes the
runtime's ``infer`` block for the model named ``hang`` (after writing a marker
file, the moment the worker holds the request), and shortens the stop's thread
bound so the test does not wait 10 s for it."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd_wire import protocol
from tests.conftest import HANG_S, DaemonFactory, wait_until
from tests.integration.test_schemas import assert_valid, frames_of, infer_header
from tests.integration.wire import IDENTITY_SHAPE

pytestmark = pytest.mark.integration

HANGING_RUN = """
import os
import threading

if os.environ.get("INFERD_TEST_HANG_MODEL"):
    from inferd import stop_budget
    from inferd.serving import engine_worker

    stop_budget.THREAD_END_S = 1.0  # the stop's wait for the worker, shortened
    _run = engine_worker.EngineWorker._run

    def _hanging(self, job):
        if job.model == os.environ["INFERD_TEST_HANG_MODEL"]:
            with open(os.environ["INFERD_TEST_HANG_MARKER"], "w") as marker:
                marker.write("running")
            threading.Event().wait(60)  # a run that does not end within the stop
        return _run(self, job)

    engine_worker.EngineWorker._run = _hanging
"""


def test_a_run_that_outlives_the_stop_is_answered_unavailable_once(
    daemon_factory: DaemonFactory, tmp_path: Path, identity_model: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HANGING_RUN)
    marker = tmp_path / "running"
    python_path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    daemon = daemon_factory(
        models=[{"name": "hang", "path": str(identity_model)}],
        daemon={"shutdown_drain_ms": 200},
        env={
            "PYTHONPATH": python_path,
            "INFERD_TEST_HANG_MODEL": "hang",
            "INFERD_TEST_HANG_MARKER": str(marker),
        },
    )
    arrays = {"input": np.ones(IDENTITY_SHAPE, np.float32)}
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.infer)
    replies: list[dict[str, Any]] = []
    try:
        sock.send_multipart([protocol.pack(infer_header("hang", arrays, id=7)), *frames_of(arrays)])
        wait_until(marker.exists, timeout=HANG_S)  # the worker holds it, and runs on
        daemon.process.send_signal(signal.SIGTERM)
        assert sock.poll(int(HANG_S * 1000)), "the request in the worker's hand was never answered"
        replies.append(protocol.unpack_header(sock.recv_multipart()[0], 1 << 16))
        assert daemon.process.wait(timeout=HANG_S) == 0
        assert not sock.poll(0), "answered twice"
    finally:
        sock.close(linger=0)
    (reply,) = replies
    assert_valid("error_reply.json", reply)
    assert reply["id"] == 7
    assert reply["error"]["code"] == "UNAVAILABLE"
    assert "stopped while this request ran" in reply["error"]["message"]
