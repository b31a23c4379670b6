"""Build events are published as the daemon kept them, never with the child's strings
whole (``engine_build/published_event.py``).

Before (review R2 of session 15): ``BuildManager._on_message`` published the event
as the child sent it.  A model whose layer names run to 4 MiB made events of 4 MiB:
one subscriber that stopped reading made the daemon hold 250 MB over three builds,
and each such event ended every ``EventSubscriber``'s connection (its bound is 64
KiB), so ``inferctl build follow`` never saw the build end.  A ``step`` of a phase
the tree never kept was published too."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import pytest

from inferd.engine_build.build_record import CHILD_TEXT_BYTES
from inferd.engine_build.events import PHASE_ID_CHARS, PHASE_TEXT_BYTES, BuildEvent
from inferd.engine_build.pipe import EventMessage, ReportMessage, encode
from inferd.engine_build.supervisor import BuildManager
from inferd.types import Peer
from inferd_wire import protocol
from tests.conftest import HANG_S
from tests.unit.engine_build.conftest import build_manager, stand_in_children

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)
_REPLAY = "import sys\nsys.stdout.buffer.write(open(sys.argv[1], 'rb').read())\n"
MIB = 2**20


def _event(
    seq: int,
    type_: str,
    phase: str | None,
    *,
    parent: str | None = None,
    name: str | None = "Timing node",
    thread: str = "builder",
    detail: dict[str, Any] | None = None,
) -> bytes:
    event = BuildEvent(
        "b1-000000", seq, type_, phase, parent, name, 0 if type_ == "step" else None, 4,
        time.monotonic_ns(), time.time_ns(), thread, "none", detail or {},
    )  # fmt: skip
    return encode(EventMessage(event))


def _stream() -> bytes:
    """A child whose model's layer names are megabytes long, then a stall and a cancel
    of megabytes of words, and a step of a phase it never started."""
    long_id, long_parent = "p" * 100_000, "q" * 100_000
    return b"".join(
        [
            _event(
                1, "phase_start", long_parent, name="L" * 4 * MIB, thread="T" * MIB,
                detail={"timingCacheMode": "cold", "junk": "j" * MIB},
            ),
            _event(2, "phase_start", long_id, parent=long_parent, name="M" * 4 * MIB),
            _event(3, "step", long_id, name="M" * 4 * MIB),
            _event(4, "step", "ghost", name="G" * MIB),
            _event(
                5, "stalled", None, name="S" * MIB,
                detail={
                    "path": ["y" * MIB] * 8, "depth": 2, "idleS": 3.5, "inARow": 1,
                    "nextAfterS": math.nan, "extra": "e" * MIB,
                },
            ),
            _event(
                6, "cancel_requested", None, name=None,
                detail={"source": "s" * MIB, "reason": "r" * MIB, "inNoCancelZone": "no"},
            ),
            _event(7, "phase_finish", long_id, name="M" * 4 * MIB),
            _event(8, "phase_finish", "ghost"),
        ]
    )  # fmt: skip


def _replayed(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch, sent: bytes
) -> tuple[BuildManager, str, list[dict[str, Any]], list[dict[str, Any]]]:
    """A real ``BuildManager``'s build whose child sends ``sent`` and exits: the manager,
    the build's id, what it published and what it recorded, once it ended."""
    stream = tmp_path / "stream"
    stream.write_bytes(sent)
    stand_in_children(monkeypatch, _REPLAY, stream)
    records: list[dict[str, Any]] = []
    manager = build_manager(
        tmp_path, {"demo": demo_model}, grace_s=1.0, record=lambda _k, p: records.append(dict(p))
    )
    published: list[dict[str, Any]] = []
    manager._publish = lambda _topic, payload: published.append(dict(payload))
    try:
        build_id = manager.start({"model": "demo", "builder": "simulated"}, OPERATOR)["build_id"]
        assert manager._get(build_id).done.wait(HANG_S)
    finally:
        manager.shutdown(wait_s=HANG_S)
    return manager, build_id, published, records


def test_a_childs_megabytes_are_published_as_the_daemon_kept_them(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, build_id, published, _records = _replayed(tmp_path, demo_model, monkeypatch, _stream())
    sizes = [len(protocol.pack(payload)) for payload in published]
    assert max(sizes) < 3 * CHILD_TEXT_BYTES, sizes  # before: 4 MiB and more each
    by_type = {(p["type"], p["eventSeq"]): p for p in published}
    assert [key[0] for key in by_type] == [
        "phase_start", "phase_start", "step", "stalled", "cancel_requested", "phase_finish",
        "failed",
    ]  # fmt: skip  # the ghost's step and finish: not published
    first, second = by_type["phase_start", 1], by_type["phase_start", 2]
    assert first["name"].endswith(f" [cut: {4 * MIB} characters]")
    assert len(first["name"].encode()) <= PHASE_TEXT_BYTES + 32
    assert first["thread"].endswith(f" [cut: {MIB} characters]")
    assert len(first["phaseId"]) == PHASE_ID_CHARS == len(second["phaseId"])
    assert second["parentId"] == first["phaseId"]  # the kept ids still link
    assert (
        by_type["step", 3]["phaseId"] == second["phaseId"] == by_type["phase_finish", 7]["phaseId"]
    )
    assert first["detail"] == {"timingCacheMode": "cold"}  # its junk left out
    assert "detail" not in second
    status = manager.status({"build_id": build_id})["build"]
    stall = by_type["stalled", 5]["detail"]
    assert stall == {
        "path": status["last_stall"]["path"],  # the daemon tree's
        "depth": 2,
        "idleS": 3.5,
        "inARow": 1,
    }
    assert len(stall["path"]) == 2 and stall["path"][1].startswith("M")
    cancel = by_type["cancel_requested", 6]["detail"]
    assert set(cancel) == {"source", "reason"}  # inNoCancelZone was no bool
    for key, letter in (("source", "s"), ("reason", "r")):
        assert cancel[key].startswith(letter) and cancel[key].endswith(f" [cut: {MIB} characters]")
        assert len(cancel[key].encode()) <= CHILD_TEXT_BYTES + 32


def test_the_terminal_event_and_record_carry_the_childs_summary_words_cut(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's own terminal event, built from the child's report: its summary's
    cancel source, timing-cache word and path were published (and recorded) whole."""
    summary = {
        "outcome": "cancelled",
        "cancelSource": "c" * MIB,
        "cancelReason": "r" * MIB,
        "timingCacheMode": "t" * MIB,
        "error": "e" * MIB,
    }
    report = encode(ReportMessage(summary, "/" + "s" * MIB))
    _manager, _id, published, records = _replayed(tmp_path, demo_model, monkeypatch, report)
    (terminal,) = published
    assert terminal["type"] == "cancelled"
    assert len(protocol.pack(terminal)) < 6 * CHILD_TEXT_BYTES  # before: 5 MiB
    for key in ("cancelSource", "cancelReason", "summaryPath", "timingCacheMode"):
        assert terminal["detail"][key].endswith(" characters]"), key
    assert len(protocol.pack(records[-1])) < 6 * CHILD_TEXT_BYTES  # the FDR's build record
