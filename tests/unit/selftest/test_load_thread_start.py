"""The self-test's client load when one of its threads cannot start (the process's
thread limit, DESIGN.md 166): ``client_load`` raises, and the clients already
started stop.  Before, their threads were started outside the ``try`` whose
``finally`` stops them: they sent on for good, and, not being daemon threads,
kept the process from exiting."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from inferd.selftest import load as load_module
from inferd.selftest.load import client_load
from tests.conftest import HANG_S
from tests.thread_limit import REFUSAL, refuse_start


class _Ended(BaseException):
    """Ends a client thread the code under test left sending (the test's own cleanup)."""


class FakeClient:
    """``inferd_client.InferenceClient`` as ``client_load`` uses it: a context
    manager whose ``infer`` answers at once, from ``runtime``."""

    ended = threading.Event()

    def __init__(self, endpoint: str, *, timeout: float) -> None:
        self.endpoint, self.timeout = endpoint, timeout
        self.last_reply: dict[str, Any] = {}

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.ended.is_set():
            raise _Ended
        self.last_reply = {"runtime": "fake"}
        return dict(inputs)


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeClient]]:
    monkeypatch.setattr(load_module, "InferenceClient", FakeClient)
    FakeClient.ended.clear()
    yield FakeClient
    FakeClient.ended.set()
    for thread in threading.enumerate():
        if thread.name.startswith("inferd-load-"):
            thread.join(HANG_S)


def test_the_clients_started_stop_when_one_cannot_start(
    fake_client: type[FakeClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_start(monkeypatch, "inferd-load-demo-2")
    with (
        pytest.raises(RuntimeError, match=REFUSAL),
        client_load(
            "ipc:///nowhere",
            "demo",
            lambda rng: {"x": rng.random(4, dtype=np.float32)},
            lambda _inputs, _outputs: True,
            clients=4,
        ),
    ):
        raise AssertionError("the load cannot run without all its clients")
    left = [t for t in threading.enumerate() if t.name.startswith("inferd-load-demo-")]
    assert left == []  # demo-0 and demo-1 sent on
