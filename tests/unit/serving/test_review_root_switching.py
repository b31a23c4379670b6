"""An operator's switch whose thread cannot be started (the process is at its
thread limit: ``RuntimeError: can't start new thread``) leaves nothing behind:
the model is not left claimed and ``stop`` still works."""

from __future__ import annotations

import threading

import pytest

from tests.unit.serving.test_switching import Rig, rig  # noqa: F401  (the fixture)


def test_a_switch_whose_thread_cannot_start_releases_the_model(
    rig: Rig,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the model stayed claimed for the rest of the run, so every later
    switch was refused "already in progress" and every failover of it deferred
    for good (a failing TensorRT engine kept serving errors), and ``stop`` raised
    on the thread it could not join, skipping the rest of the shutdown."""
    start = threading.Thread.start

    def refused(thread: threading.Thread) -> None:
        if thread.name.startswith("inferd-switch-"):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refused)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        rig.switch()
    assert rig.switcher.claim("m"), "the model is still claimed by the switch"
    rig.switcher.unclaim("m")
    rig.switcher.stop()  # raised RuntimeError: cannot join thread before it is started
