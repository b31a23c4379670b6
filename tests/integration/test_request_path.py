"""The request path shared by the engine worker and the bus thread (DESIGN.md 101),
through a real daemon: an idle daemon's requests are read by the engine worker
itself, and under load, with both threads taking turns on the infer socket, every
request of every client is answered once, with its own result."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from inferd_client import InferenceClient, OperatorClient
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.wire import IDENTITY_SHAPE

pytestmark = pytest.mark.integration


def _status(daemon: DaemonProcess) -> dict[str, Any]:
    with OperatorClient(daemon.control, timeout=5) as operator:
        return operator.status()


def _answered(status: dict[str, Any], model: str) -> int:
    entry = next(m for m in status["models"] if m["model"] == model)
    return int(entry["requests"])


@pytest.fixture
def identity_daemon(daemon_factory: DaemonFactory, identity_model: Any) -> DaemonProcess:
    return daemon_factory(models=[{"name": "identity", "path": str(identity_model)}])


def test_an_idle_daemon_reads_each_request_on_the_engine_worker(
    identity_daemon: DaemonProcess,
) -> None:
    x = np.random.default_rng(3).standard_normal(IDENTITY_SHAPE, dtype=np.float32)
    before = _status(identity_daemon)["bus"]["read_by_worker"]
    with InferenceClient(identity_daemon.infer, timeout=10) as client:
        for _ in range(50):
            assert np.array_equal(client.infer("identity", {"input": x})["output"], x)
    read = _status(identity_daemon)["bus"]["read_by_worker"] - before
    # One request at a time, each a short run: the worker is listening whenever one
    # arrives.  (A request the bus thread read instead would still be served.)
    assert read >= 45, read


def test_every_request_of_every_client_is_answered_while_both_threads_read(
    identity_daemon: DaemonProcess,
) -> None:
    clients, requests = 6, 120
    failures: list[str] = []

    def client_loop(index: int) -> None:
        rng = np.random.default_rng(index)
        try:
            with InferenceClient(identity_daemon.infer, timeout=30) as client:
                for number in range(requests):
                    batch = int(rng.integers(1, 4))
                    x = np.full((batch, *IDENTITY_SHAPE[1:]), index * 1000 + number, np.float32)
                    y = client.infer("identity", {"input": x})["output"]
                    if not np.array_equal(y, x):
                        failures.append(f"client {index} request {number}: another result")
        except Exception as exc:  # collected: the assertion below names it
            failures.append(f"client {index}: {exc!r}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    polls = 0
    while any(thread.is_alive() for thread in threads):  # control traffic meanwhile
        _status(identity_daemon)
        polls += 1
        threads[0].join(0.05)
    for thread in threads:
        thread.join()
    assert failures == []
    status = _status(identity_daemon)
    served = _answered(status, "identity")
    assert served == clients * requests
    by_worker = status["bus"]["read_by_worker"]
    # Six clients keep the worker busy: the bus thread read some requests, the
    # worker the others whenever its queue ran dry.
    assert 0 < by_worker < served, (by_worker, served)
    assert status["bus"]["unroutable_replies"] == 0
    assert status["bus"]["replies"]["dropped"] == 0
    assert polls > 0
