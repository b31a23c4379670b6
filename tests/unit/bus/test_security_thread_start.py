"""``BusSecurity`` when one of its threads cannot start (the process's thread
limit, DESIGN.md 166): its ``stop``, which the daemon runs after the failed
start, stops what did start and raises nothing.  Before, the stop joined the
thread that never started (``RuntimeError: cannot join thread before it is
started``) before it stopped the ZAP handler: ``inferd-zap`` ran on, holding
its socket, and the ZeroMQ context could not be terminated."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd.bus.security import BusSecurity
from tests.conftest import HANG_S
from tests.thread_limit import REFUSAL, refuse_start
from tests.unit.config.test_config import MINIMAL, load_text


def _terminated(context: zmq.Context[Any]) -> bool:
    """Whether ``context.term()`` returns within ``HANG_S`` (it waits for every
    socket of the context to close: the ZAP handler's, while it runs)."""
    ended = threading.Event()

    def term() -> None:
        context.term()
        ended.set()

    threading.Thread(target=term, name="test-context-term", daemon=True).start()
    return ended.wait(HANG_S)


@pytest.mark.parametrize("refused", ["inferd-fd-guard", "inferd-zap"])
def test_a_thread_that_cannot_start_leaves_nothing_after_the_stop(
    refused: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_text(tmp_path, "[shm]\nenabled = false\n" + MINIMAL)
    context: zmq.Context[Any] = zmq.Context()
    security = BusSecurity(context, config)
    refuse_start(monkeypatch, refused)
    with pytest.raises(RuntimeError, match=REFUSAL):
        security.start()
    monkeypatch.undo()
    security.stop(HANG_S)  # raised before, for either thread
    assert security.zap is not None and not security.zap.is_alive()  # inferd-zap ran on
    assert security.guard is None or not security.guard.is_alive()
    assert _terminated(context)
