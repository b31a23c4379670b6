"""A bug that ends the engine worker (DESIGN.md 126): the request it was answering
gets INTERNAL, every queued one UNAVAILABLE, a CRITICAL alert is raised and the
daemon exits with status 1 for systemd to restart it, instead of holding the
requests until the watchdog kills it.

The bug is injected: a ``sitecustomize`` on the daemon's ``PYTHONPATH`` makes the
worker raise while answering a request for the model named ``poison``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd_wire import protocol
from tests.conftest import HANG_S, DaemonFactory, write_slow_model
from tests.integration.test_schemas import assert_valid, frames_of, infer_header

pytestmark = pytest.mark.integration

POISONED_WORKER = """
import os

if os.environ.get("INFERD_TEST_POISON_MODEL"):
    from inferd.serving import engine_worker

    _answer = engine_worker.EngineWorker._answer

    def _poisoned(self, job):
        if job.model == os.environ["INFERD_TEST_POISON_MODEL"]:
            job.finish()
            self._scheduler.task_done()
            raise RuntimeError("injected by the test: a bug in the worker")
        return _answer(self, job)

    engine_worker.EngineWorker._answer = _poisoned
"""


def test_a_dead_worker_answers_every_request_and_the_daemon_exits_to_be_restarted(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(POISONED_WORKER)
    python_path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    # Runs long enough for the requests after it to queue behind it.
    slow = write_slow_model(tmp_path / "slow.onnx", matmuls=72)
    daemon = daemon_factory(
        models=[
            {"name": "slow", "path": str(slow)},
            {"name": "poison", "path": str(slow)},
        ],
        env={"PYTHONPATH": python_path, "INFERD_TEST_POISON_MODEL": "poison"},
    )
    arrays = {"x": np.ones((512, 512), np.float32)}
    # Round-robin across models: after 1 the worker takes 2, and 3 and 4 are left.
    sent = {1: "slow", 2: "poison", 3: "slow", 4: "slow"}
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.infer)
    replies: dict[int, dict[str, Any]] = {}
    try:
        for request_id, model in sent.items():
            header = infer_header(model, arrays, id=request_id)
            sock.send_multipart([protocol.pack(header), *frames_of(arrays)])
        while len(replies) < len(sent):
            assert sock.poll(int(HANG_S * 1000)), f"unanswered: {set(sent) - set(replies)}"
            reply = protocol.unpack_header(sock.recv_multipart()[0], 1 << 16)
            assert reply["id"] not in replies, f"answered twice: {reply}"
            replies[reply["id"]] = reply
    finally:
        sock.close(linger=0)
    assert replies[1]["ok"] is True
    for reply in (replies[2], replies[3], replies[4]):
        assert_valid("error_reply.json", reply)
    assert replies[2]["error"]["code"] == "INTERNAL"
    assert "(RuntimeError)" in replies[2]["error"]["message"]
    assert "(engine_worker_died)" in replies[2]["error"]["message"]  # where the text is
    assert [replies[i]["error"]["code"] for i in (3, 4)] == ["UNAVAILABLE", "UNAVAILABLE"]
    # The exception's text is the operator's (bus.internal_errors): in the log alone.
    assert not any("injected by the test" in replies[i]["error"]["message"] for i in (2, 3, 4))
    assert daemon.process.wait(timeout=HANG_S) == 1
    log = daemon.log()
    assert "engine_worker_died" in log and "Traceback" in log
    assert "injected by the test" in log
    alerts = [record.payload for record in daemon.fdr_records("alert")]
    assert any(alert["code"] == "engine_worker_died" for alert in alerts), alerts
