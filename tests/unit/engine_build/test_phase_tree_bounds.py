"""The daemon keeps at most ``MAX_PHASES`` phases of a build, holding at most
``MAX_PHASE_TEXT`` characters of ids, names and threads (``events.PhaseTree``,
``build_record.Build.tree``, ``said_refused``).

Before, a build's tree in the daemon's memory took every ``phase_start`` its child
sent: millions of them were all kept, and ``build.status ID`` sorted them all under
the build's lock.  A new phase past either bound is dropped and counted
(``build.status`` ``events.phases_dropped``), logged once per build; its later steps
and finish change nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import structlog

from inferd.config import BuildsConfig
from inferd.engine_build import build_record
from inferd.engine_build.events import MAX_PHASE_TEXT, MAX_PHASES, BuildEvent, PhaseTree
from inferd.types import Peer
from tests.conftest import HANG_S, wait_until
from tests.integration.test_schemas import assert_valid
from tests.unit.engine_build.conftest import build_manager, stand_in_children

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)


def _event(
    seq: int, type_: str, phase: str, name: str = "Timing node", step: int = 0
) -> BuildEvent:
    return BuildEvent(
        "b1-000000", seq, type_, phase, None, name, step, 1,
        time.monotonic_ns(), time.time_ns(), "t", "none",
    )  # fmt: skip


def test_the_daemons_tree_of_a_build_is_bounded_and_a_childs_own_is_not() -> None:
    tree = build_record.Build.__dataclass_fields__["tree"].default_factory()  # type: ignore[misc]
    assert (tree.max_phases, tree.max_text, tree.cut) == (MAX_PHASES, MAX_PHASE_TEXT, True)
    assert (PhaseTree().max_phases, PhaseTree().max_text, PhaseTree().cut) == (None, None, False)


def test_phases_past_max_phases_are_dropped_counted_and_their_events_change_nothing() -> None:
    tree = PhaseTree(MAX_PHASES, MAX_PHASE_TEXT)
    extra = 100
    applied = [tree.apply(_event(i, "phase_start", f"p{i}")) for i in range(MAX_PHASES + extra)]
    assert applied.count(False) == extra and applied[MAX_PHASES:] == [False] * extra
    assert len(tree.nodes) == MAX_PHASES and tree.dropped == extra and tree.refused == 0
    assert tree.refusal == "phases"
    # A dropped phase's step and finish: no error, no node, nothing else changed.
    dropped = f"p{MAX_PHASES + 1}"
    assert tree.apply(_event(1, "step", dropped)) is True
    assert tree.apply(_event(2, "phase_finish", dropped)) is True
    assert dropped not in tree.nodes and len(tree.nodes) == MAX_PHASES
    assert sum(len(node.children) for node in tree.nodes.values()) == 0
    assert len(tree.roots) == MAX_PHASES
    # A kept phase's events still apply.
    assert tree.apply(_event(3, "step", "p0")) and tree.apply(_event(4, "phase_finish", "p0"))
    assert tree.nodes["p0"].status == "finished"


def test_a_phase_past_the_text_bound_is_dropped_and_a_smaller_one_still_fits() -> None:
    tree = PhaseTree(max_phases=10, max_text=100)
    assert tree.apply(_event(1, "phase_start", "p1", name="x" * 50))  # 2 + 50 + 1
    assert not tree.apply(_event(2, "phase_start", "p2", name="y" * 60))
    assert tree.refusal == "text" and tree.dropped == 1 and tree.text == 53
    assert tree.apply(_event(3, "phase_start", "p3", name="z" * 40))  # 53 + 43 = 96
    assert list(tree.nodes) == ["p1", "p3"] and tree.text == 96


def test_a_cycle_refusal_is_still_counted_apart() -> None:
    tree = PhaseTree(max_phases=1)
    assert tree.apply(_event(1, "phase_start", "p1"))
    assert not tree.apply(_event(2, "phase_start", "p1"))  # the same id: a cycle
    assert (tree.refused, tree.dropped, tree.refusal) == (1, 0, "cycle")
    assert not tree.apply(_event(3, "phase_start", "p2"))
    assert (tree.refused, tree.dropped, tree.refusal) == (1, 1, "phases")


#: A stand-in build child: ``count`` phase_start events, then a step and a finish of
#: each, then it exits without a report.
_CHILD = """
import sys, time, msgpack
count = int(sys.argv[1])
def ev(seq, kind, phase):
    return msgpack.packb({'kind': 'event', 'event': {'buildId': 'x', 'seq': seq,
        'type': kind, 'phaseId': phase, 'parentId': None, 'name': 'Timing node',
        'step': 0, 'numSteps': 1, 'monotonicNs': time.monotonic_ns(),
        'wallNs': time.time_ns(), 'thread': 't', 'cancelState': 'none'}})
out = sys.stdout.buffer
for kind in ('phase_start', 'step', 'phase_finish'):
    out.write(b''.join(ev(i, kind, f'p{i}') for i in range(count)))
out.flush()
"""


def test_build_status_counts_the_dropped_phases_and_the_log_says_it_once(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the daemon's build manager, the bound made small (the real one's
    behaviour is the same; ``MAX_PHASES`` phases would cost the test seconds)."""
    bound, extra = 40, 25
    monkeypatch.setattr(build_record, "MAX_PHASES", bound)
    stand_in_children(monkeypatch, _CHILD, bound + extra)
    manager = build_manager(
        tmp_path, {"demo": demo_model}, grace_s=0.3, limits=BuildsConfig(start_burst=10)
    )
    try:
        with structlog.testing.capture_logs() as logs:
            build_id = manager.start({"model": "demo", "builder": "simulated"}, OPERATOR)[
                "build_id"
            ]
            build = manager._get(build_id)
            assert build.done.wait(HANG_S), "the build never ended"
        wait_until(lambda: build.received == 3 * (bound + extra), message="every event read")
        status = manager.status({"build_id": build_id})["build"]
        assert status["events"]["phases_dropped"] == extra and status["events"]["refused"] == 0
        assert status["phase_tree"]["phases"] == bound
        assert_valid(
            "build_status_reply.json#/$defs/ok",
            {"v": 1, "id": 1, "ok": True, "result": {"build": status}},
        )
        (said,) = [e for e in logs if e["event"] == "build_phases_dropped"]
        assert said["build_id"] == build_id and said["bound"] == "phases"
        assert said["phases"] == bound and said["max_phases"] == bound
        assert not [e for e in logs if e["event"] == "build_phase_event_refused"]
        # The kept phases were finished; none of the dropped ones appeared.
        assert all(node.status == "finished" for node in build.tree.nodes.values())
        assert set(build.tree.nodes) == {f"p{i}" for i in range(bound)}
    finally:
        manager.shutdown(wait_s=HANG_S)
