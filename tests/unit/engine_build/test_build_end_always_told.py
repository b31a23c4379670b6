"""Every build that leaves the running set is told to ``on_finished``, and the
rebuilder handles its end, whatever went wrong meanwhile (``BuildManager._ended``,
``child_exit.keep_ended``, ``FallbackRebuilder.on_build_finished`` and ``_start``).

Before, a build whose tree made ``keep_shown`` raise (a ``step`` of 2**64 - 1, which
the pipe took) was never told: its rebuild read "building" for the daemon's run, a
rebuild waiting for room waited for ever, and ``build.status ID`` raised
``OverflowError``.  And a waiting rebuild whose start raised anything but a
``ProtocolError`` (admission's prune failing to unlink: ``PermissionError``) took
the ended build's handling down with it: no alert, no retry, "building" for ever.
The daemon's wiring (``test_builds_max_running._Daemon``, ``builds.max_running`` 1)
with stand-in children started as ``child_process.spawn`` starts one."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import structlog

from inferd.engine_build.events import BuildEvent, PhaseTree
from inferd.engine_build.pipe import EventMessage, encode
from tests.conftest import wait_until
from tests.unit.engine_build.conftest import stand_in_children
from tests.unit.engine_build.test_builds_max_running import _Daemon, _end, _start

#: A stand-in build child: the first build's (``b1-``) writes the file it is given to
#: its stdout and exits 0; any other runs until the cancel on its stdin.
_FIRST_SAYS = (
    "import json, sys\n"
    "if json.loads(sys.argv[-1])['build_id'].startswith('b1-'):\n"
    "    sys.stdout.buffer.write(open(sys.argv[1], 'rb').read())\n"
    "else:\n"
    "    sys.stdin.buffer.read(1)\n"
)


def _phase(seq: int, type_: str) -> BuildEvent:
    return BuildEvent("b1", seq, type_, "p1", None, "layer", 0, 4, seq, seq, "t", "none")


@pytest.fixture
def daemon(tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Daemon]:
    """The first build's child sends a phase and a step of it of 2**64 - 1 (a valid
    msgpack uint64), then exits 0 without a report."""
    said = tmp_path / "said"
    huge_step = {**_phase(2, "step").as_dict(), "step": 2**64 - 1}
    said.write_bytes(
        encode(EventMessage(_phase(1, "phase_start")))
        + msgpack.packb({"kind": "event", "event": huge_step})
    )
    stand_in_children(monkeypatch, _FIRST_SAYS, said, spec=True)
    wired = _Daemon(tmp_path, demo_model)
    yield wired
    wired.close()


@pytest.fixture
def waiting(tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Daemon]:
    """Every child runs until the cancel on its stdin (or its kill)."""
    stand_in_children(monkeypatch, "import sys\nsys.stdin.buffer.read(1)\n")
    wired = _Daemon(tmp_path, demo_model)
    yield wired
    wired.close()


def test_a_step_past_int64_is_refused_and_the_builds_end_is_told(daemon: _Daemon) -> None:
    with structlog.testing.capture_logs() as logs:
        assert daemon.rebuilder.on_fallback("a", "engine missing") is None  # b1: its child
        assert daemon.rebuilder.on_fallback("b", "engine missing") is None  # waits for room
        first = daemon.rebuilder.describe()["a"]["build_id"]
        wait_until(lambda: daemon.told, message="the end of the rebuild of 'a' told")
        rebuild = wait_until(
            lambda: daemon.rebuilder.describe()["b"]["build_id"], message="'b' started"
        )
    assert daemon.told == [first] and daemon.manager._get(rebuild).model == "b"
    assert [e["why"] for e in logs if e["event"] == "build_pipe_malformed_message"] == [
        "'step' is outside 0..9223372036854775807"
    ]
    # The rebuild of 'a' failed and was handled: alerted, its retry waits for room.
    assert daemon.rebuilder.describe()["a"]["build_id"] != first
    assert [(a.code, a.fields["model"]) for a in daemon.alerts] == [("engine_build_failed", "a")]
    # build.status ID answers for it (it raised OverflowError).
    status = daemon.manager.status({"build_id": first})["build"]
    assert status["state"] == "failed" and status["phase_tree"]["roots"][0]["step"] is None


def test_a_build_whose_trim_raises_is_told_all_the_same(
    waiting: _Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever makes keeping what ``build.status`` shows raise at the end (here the
    tree's ``keep_only``), the end is logged and told: the waiting rebuild starts."""
    daemon = waiting
    operators = _start(daemon.manager, "a")
    assert daemon.rebuilder.on_fallback("b", "engine missing") is None  # waits for room

    def fails(_tree: PhaseTree, _kept: object) -> None:
        raise RuntimeError("a bug")

    with monkeypatch.context() as patch, structlog.testing.capture_logs() as logs:
        patch.setattr(PhaseTree, "keep_only", fails)  # undone before the rebuild's end
        _end(daemon.manager, operators)
        rebuild = wait_until(
            lambda: daemon.rebuilder.describe()["b"]["build_id"], message="'b' started"
        )
    assert daemon.told == [operators] and daemon.manager._get(rebuild).model == "b"
    (failed,) = [e for e in logs if e["event"] == "build_keep_ended_failed"]
    assert failed["build_id"] == operators and failed["exc_info"] is True


def test_a_waiting_rebuild_whose_start_raises_leaves_the_ended_build_handled(
    waiting: _Daemon,
) -> None:
    """The ended rebuild of 'a' failed (its child killed); the waiting rebuild of 'b',
    asked for again at that end, meets a ``PermissionError`` (prune's unlink in
    ``admission.admit``): both are alerted, 'a' is retried, and nothing reads
    "building" for a build that ended."""
    daemon = waiting
    admit = daemon.manager.admission.admit

    def unlink_refused(peer: object, running: object, incoming: object = None) -> None:
        if getattr(incoming, "model", None) == "b":
            raise PermissionError(1, "Operation not permitted", "builds/b/old.engine")
        admit(peer, running, incoming)  # type: ignore[arg-type]

    daemon.manager.admission.admit = unlink_refused  # type: ignore[method-assign]
    assert daemon.rebuilder.on_fallback("a", "engine missing") is None  # b1
    first = daemon.rebuilder.describe()["a"]["build_id"]
    assert daemon.rebuilder.on_fallback("b", "engine missing") is None  # waits for room
    with structlog.testing.capture_logs() as logs:
        daemon.manager._get(first).process.send_signal(signal.SIGKILL)
        wait_until(lambda: daemon.told == [first], message="the end of b1 told and handled")
        retry = wait_until(
            lambda: (
                daemon.rebuilder.describe()["a"]["build_id"] not in (None, first)
                and daemon.rebuilder.describe()["a"]["build_id"]
            ),
            message="the retry of 'a' started",
        )
    alerts = [(a.code, a.fields["model"], a.message) for a in daemon.alerts]
    # 'b' could not start, an attempt retried after the backoff (0 s here: its retry
    # may meet the same fault, or wait for the room 'a''s retry holds; DESIGN.md 354).
    b_alerts = [alert for alert in alerts if alert[1] == "b"]
    assert b_alerts[0][0] == "engine_build_failed"
    assert "could not start: PermissionError: [Errno 1]" in b_alerts[0][2]
    assert b_alerts[0][2].endswith("retry 2 of 3 in 0 s")
    a_alerts = [alert for alert in alerts if alert[1] == "a"]  # failed, retried
    assert [code for code, *_ in a_alerts] == ["engine_build_failed"]
    assert "retry 2 of 3" in a_alerts[0][2]
    not_started = next(e for e in logs if e["event"] == "engine_rebuild_not_started")
    assert not_started["model"] == "b" and not_started["exc_info"] is True
    assert daemon.manager._get(retry).model == "a"
    assert daemon.rebuilder.describe()["b"]["build_id"] is None
    assert not [e for e in logs if e["event"] == "build_finished_hook_failed"]
    assert daemon.manager.running() == 1
