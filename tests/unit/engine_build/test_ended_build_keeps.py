"""What the daemon keeps of what a build child sent, once the build ended
(``child_exit.keep_ended``, ``supervisor.BuildManager._on_message``), and what its
pipe refuses (``pipe.event_from_dict``); a phase's unknown parent id
(``events.PhaseTree.apply``).

Before, a finished build kept its child's summary whole (the child's own phase tree,
every phase: 11 MB at 16,384 phases of TensorRT-like names, 1.2 GB for a 16 MiB
report of empty maps), its FDR record, its error and the type of its last event
(any string), each up to a 16 MiB message, for each of the 32 finished builds kept;
a ``step`` of 2**64 - 1 made ``build.status ID`` (and the end's ``keep_shown``) raise
``OverflowError``; and the daemon's tree kept a phase's unknown parent id, uncounted
by its text bound (21.4 MB where 16.5 MB was said the worst)."""

from __future__ import annotations

import gc
import os
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import pytest

from inferd.config import BuildsConfig
from inferd.engine_build import build_record
from inferd.engine_build.build_record import CHILD_TEXT_BYTES, BuildFinished
from inferd.engine_build.child_exit import ENDED_SUMMARY
from inferd.engine_build.events import (
    EVENT_TYPES,
    MAX_PHASE_TEXT,
    MAX_PHASES,
    PHASE_ID_CHARS,
    PHASE_TEXT_BYTES,
    BuildEvent,
    PhaseTree,
)
from inferd.engine_build.pipe import (
    MAX_STEP,
    EventMessage,
    MalformedMessage,
    ReportMessage,
    encode,
    event_from_dict,
)
from inferd.types import Peer
from tests.conftest import HANG_S, wait_until
from tests.unit.engine_build.conftest import build_manager, stand_in_children

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)
#: A character of 4 bytes in UTF-8, and 4 bytes in a Python string too.
WIDE = "\U0001f600"
#: A stand-in build child: writes the file it is given to its stdout, and exits 0.
_REPLAY = "import sys\nsys.stdout.buffer.write(open(sys.argv[1], 'rb').read())\n"
#: What the child's summary says that ``build.status`` shows once the build ended.
_WORDS = {
    "cleanupStatus": "cleaned",
    "retryPolicy": "do_not_retry",
    "validationStatus": "not_run",
    "timingCacheMode": "discarded",
    "cancelLatencyMs": 1.5,
    "cleanupLatencyMs": 2,
}


def _event(
    seq: int,
    type_: str,
    phase: str | None,
    parent: str | None = None,
    name: str = "Timing node",
    step: int | None = 0,
    thread: str = "t",
) -> BuildEvent:
    return BuildEvent(
        "b1-000000", seq, type_, phase, parent, name, step, 1,
        time.monotonic_ns(), time.time_ns(), thread, "none",
    )  # fmt: skip


def _childs_summary(phases: int) -> dict[str, Any]:
    """A failed build's summary as a child's report carries it: its own tree (unbounded,
    uncut: ``session.py``'s ``phaseTree``) of ``phases`` TensorRT-like phases."""
    tree = PhaseTree()
    for i in range(phases):
        name = f"/model/encoder/layers.{i}/self_attn/MatMul_{i:05d} + /model/encoder/Add_{i}"
        tree.apply(_event(i, "phase_start", f"p{i}", "p0" if i else None, name))
        tree.apply(_event(i, "phase_finish", f"p{i}"))
    return {"outcome": "failed", "error": "stand-in", "phaseTree": tree.snapshot(), **_WORDS}


def _stream(big: int) -> bytes:
    """What the stand-in child sends: a phase, a step of it of 2**64 - 1 and an event of
    an unknown type (both refused), a record and an error of ``big`` items each, then
    its report."""
    huge_step = {**_event(2, "step", "p1").as_dict(), "step": 2**64 - 1}
    unknown = {**_event(3, "phase_start", None).as_dict(), "type": "x" * big}
    return b"".join(
        [
            encode(EventMessage(_event(1, "phase_start", "p1"))),
            msgpack.packb({"kind": "event", "event": huge_step}),
            msgpack.packb({"kind": "event", "event": unknown}),
            msgpack.packb({"kind": "record", "payload": {"p": [{}] * big}}),
            msgpack.packb({"kind": "error", "error": "e" * big}),
            encode(ReportMessage(_childs_summary(2048), "/nonexistent/b.build.json")),
        ]
    )


def test_an_ended_build_keeps_only_what_build_status_shows_of_what_its_child_sent(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of the child's messages within the pipe's bound, as the daemon's decoder
    reads them: once the build ended the daemon holds under 0.5 MB of it (before: the
    summary alone 1.4 MB, its record, error and last event type 4.7 MB more)."""
    stream = tmp_path / "stream"
    stream.write_bytes(_stream(big=2**16))
    stand_in_children(monkeypatch, _REPLAY, stream)
    manager = build_manager(tmp_path, {"demo": demo_model}, grace_s=1.0, limits=BuildsConfig())
    told: list[BuildFinished] = []
    manager._on_finished = told.append
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        build_id = manager.start({"model": "demo", "builder": "simulated"}, OPERATOR)["build_id"]
        wait_until(lambda: told, message="the build's end told")
        for reader in threading.enumerate():  # its decoder's buffers go with it
            if reader.name == f"inferd-build-{build_id}":
                reader.join(HANG_S)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        manager.shutdown(wait_s=HANG_S)
    build = manager._get(build_id)
    assert held < 500_000, f"an ended build holds {held:,} bytes"
    assert build.summary == _WORDS and set(_WORDS) == set(ENDED_SUMMARY)
    assert build.record is None
    assert build.tree.last_event == "phase_start" and build.tree.phases == 1
    status = manager.status({"build_id": build_id})["build"]  # answers: the step was refused
    assert status["phase_tree"]["roots"][0]["step"] is None  # no step of it taken
    assert (status["state"], status["error"]) == ("failed", "stand-in")  # the summary's
    assert status["cleanup_status"] == "cleaned" and status["retry_policy"] == "do_not_retry"
    assert (status["validation_status"], status["timing_cache_mode"]) == ("not_run", "discarded")
    assert (status["cancel_latency_ms"], status["cleanup_latency_ms"]) == (1.5, 2)
    assert status["summary_path"] == "/nonexistent/b.build.json"


def test_a_childs_error_is_kept_as_build_status_shows_it(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = tmp_path / "stream"
    stream.write_bytes(msgpack.packb({"kind": "error", "error": "\u00e9" * 2**20}))
    stand_in_children(monkeypatch, _REPLAY, stream)
    manager = build_manager(tmp_path, {"demo": demo_model}, grace_s=1.0)
    try:
        build_id = manager.start({"model": "demo", "builder": "simulated"}, OPERATOR)["build_id"]
        assert manager._get(build_id).done.wait(HANG_S)
    finally:
        manager.shutdown(wait_s=HANG_S)
    error = manager._get(build_id).error
    assert error is not None and len(error.encode()) < CHILD_TEXT_BYTES + 32
    assert error.endswith(f" [cut: {2**20} characters]")  # the length as the child sent it
    assert manager.status({"build_id": build_id})["build"]["error"] == error


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("type", "x"),
        ("type", "phase_start "),
        ("step", 2**64 - 1),
        ("step", MAX_STEP + 1),
        ("step", -1),
        ("numSteps", 2**63),
        ("numSteps", -2),
    ],
)
def test_the_pipe_refuses_an_unknown_event_type_and_a_step_past_int64(
    key: str, value: object
) -> None:
    with pytest.raises(MalformedMessage):
        event_from_dict({**_event(1, "step", "p1").as_dict(), key: value})


def test_the_pipe_takes_every_event_type_and_steps_up_to_int64() -> None:
    for type_ in EVENT_TYPES:
        assert event_from_dict(_event(1, type_, "p1").as_dict()).type == type_
    most = {**_event(1, "step", "p1").as_dict(), "step": MAX_STEP, "numSteps": MAX_STEP}
    assert (event_from_dict(most).step, event_from_dict(most).num_steps) == (MAX_STEP, MAX_STEP)


def test_a_phases_unknown_parent_id_is_not_kept_by_the_daemons_tree() -> None:
    daemons: PhaseTree = build_record.Build.__dataclass_fields__["tree"].default_factory()  # type: ignore[misc]
    childs = PhaseTree()
    for tree in (daemons, childs):
        assert tree.apply(_event(1, "phase_start", "p1", "gone"))
        assert tree.apply(_event(2, "phase_start", "p2", "p1"))
    assert (daemons.nodes["p1"].parent_id, daemons.nodes["p2"].parent_id) == (None, "p1")
    assert daemons.roots == ["p1"] and daemons.nodes["p1"].children == ["p2"]
    assert childs.nodes["p1"].parent_id == "gone"  # a child's own tree keeps it (inferd build)


#: As ``test_phase_tree_memory``: an eighth of both bounds, the bound scaled back.
_SCALE = 8


def test_a_full_tree_whose_phases_name_unknown_parents_holds_under_18_mb() -> None:
    """Every phase at both bounds (ids of ``PHASE_ID_CHARS``, names and threads of 32
    4-byte characters), each naming a parent of 64 4-byte characters the tree does not
    have: 21.4 MB before, the parent ids uncounted by ``MAX_PHASE_TEXT``."""
    phases = MAX_PHASES // _SCALE
    text = WIDE * (PHASE_TEXT_BYTES // 4)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tree: PhaseTree = build_record.Build.__dataclass_fields__["tree"].default_factory()  # type: ignore[misc]
        tree.max_phases, tree.max_text = phases, MAX_PHASE_TEXT // _SCALE
        for seq in range(phases):  # each string a new object, as the pipe's decoder makes it
            phase = f"{seq:05d}{WIDE * (PHASE_ID_CHARS - 5)}"
            parent = f"{seq:05d}{WIDE * (PHASE_ID_CHARS - 5)}"[::-1]
            tree.apply(_event(seq, "phase_start", phase, parent, text, None, text))
        running = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(tree.nodes) == phases and all(n.parent_id is None for n in tree.nodes.values())
    assert running * _SCALE < 18_000_000, f"a full tree holds {running * _SCALE:,} bytes"
