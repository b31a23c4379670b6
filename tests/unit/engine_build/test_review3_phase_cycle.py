"""A build child's phase events that would make the phase tree a cycle are refused
and counted (``PhaseTree.apply``), and no walk of the tree can loop (review G, F3).

Before, a ``phase_start`` whose id the tree already had replaced that node, and one
whose parent was itself made the node its own child: ``active_path`` then appended
for ever, so ``build.status`` never returned, holding ``build.lock``; the build's
reader blocked on that lock, and the build stayed ``running`` after its child died.
The decoder passes both events (they are well formed)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inferd.config import BuildsConfig
from inferd.engine_build.events import BuildEvent, PhaseTree
from inferd.engine_build.pipe import EventMessage, child_message_decoder, encode
from inferd.types import Peer
from tests.conftest import HANG_S, wait_until
from tests.unit.engine_build.conftest import build_manager, stand_in_children

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)


def _start(seq: int, phase: str, parent: str | None) -> BuildEvent:
    return BuildEvent(
        "b1-000000", seq, "phase_start", phase, parent, "Building engine", None, 1,
        time.monotonic_ns(), time.time_ns(), "t", "none",
    )  # fmt: skip


def _within(call: Callable[[], Any], seconds: float = HANG_S) -> Any:
    """``call()``'s result; fails when it has not returned within ``seconds``."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call} did not return within {seconds} s (a loop)"
    return result["value"]


@pytest.mark.parametrize(
    "second", [("p1", "p1"), ("p1", None), ("p2", "p2")], ids=["own-parent", "same-id", "self"]
)
def test_a_phase_start_that_would_make_a_cycle_is_refused_and_counted(
    second: tuple[str, str | None],
) -> None:
    stream = encode(EventMessage(_start(1, "p1", None))) + encode(EventMessage(_start(2, *second)))
    decoder = child_message_decoder(build_id="b1-000000")
    messages = decoder.feed(stream)
    assert decoder.malformed == 0 and len(messages) == 2  # well formed: the decoder passes it
    tree = PhaseTree()
    applied = [tree.apply(m.event) for m in messages if isinstance(m, EventMessage)]
    assert applied == [True, False]
    assert tree.refused == 1
    snapshot = _within(tree.snapshot)
    assert snapshot["phases"] == 1 and snapshot["activePath"] == ["Building engine"]
    assert [root["id"] for root in snapshot["roots"]] == ["p1"]
    assert snapshot["roots"][0]["children"] == []
    assert _within(tree.render) == "- Building engine [running 0/1]"


def test_a_cycle_made_behind_the_trees_back_still_ends_every_walk() -> None:
    """Defence in depth: the walks keep a visited set, whatever the nodes say."""
    tree = PhaseTree()
    tree.apply(_start(1, "p1", None))
    tree.apply(_start(2, "p2", "p1"))
    tree.nodes["p2"].children.append("p1")  # p1 -> p2 -> p1
    tree.nodes["p1"].children.append("p1")
    snapshot = _within(tree.snapshot)
    assert snapshot["activePath"] == ["Building engine", "Building engine"]
    assert _within(tree.render).count("\n") == 1


def test_build_status_returns_and_the_build_ends_after_such_events(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the daemon's build manager, with a stand-in child started as
    ``child_process.spawn`` starts one, that writes the two events and waits (deaf
    to the cancel: killed after the grace)."""
    child = (
        "import sys, time, msgpack\n"
        "def ev(seq, parent):\n"
        "    return {'kind': 'event', 'event': {'buildId': 'x', 'seq': seq,\n"
        "        'type': 'phase_start', 'phaseId': 'p1', 'parentId': parent,\n"
        "        'name': 'Building engine', 'step': 0, 'numSteps': 1,\n"
        "        'monotonicNs': time.monotonic_ns(), 'wallNs': time.time_ns(),\n"
        "        'thread': 't', 'cancelState': 'none'}}\n"
        "sys.stdout.buffer.write(msgpack.packb(ev(1, None)) + msgpack.packb(ev(2, 'p1')))\n"
        "sys.stdout.flush()\n"
        "time.sleep(60)\n"
    )
    stand_in_children(monkeypatch, child)
    manager = build_manager(
        tmp_path, {"demo": demo_model}, grace_s=0.3, limits=BuildsConfig(start_burst=10)
    )
    build_id = manager.start({"model": "demo", "builder": "simulated"}, OPERATOR)["build_id"]
    build = manager._get(build_id)
    wait_until(lambda: build.received == 2, timeout=60, message="both events read")
    status = _within(lambda: manager.status({"build_id": build_id}))["build"]
    assert status["phase_tree"]["phases"] == 1
    assert status["events"]["refused"] == 1
    listing = _within(lambda: manager.status({}))
    assert [b["build_id"] for b in listing["builds"]] == [build_id]
    cancel = _within(lambda: manager.cancel({"build_id": build_id}, OPERATOR))
    assert cancel["accepted"] is True
    assert build.done.wait(HANG_S), "the build never ended"
    assert build.state == "cancelled" and build.escalated is True
