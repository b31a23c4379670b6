"""What the daemon holds of a build's phase tree fits what ``build.status`` shows of
it (``events.PhaseTree`` with ``cut``, ``status_view.keep_shown``,
``supervisor.BuildManager._ended``).

Before, the daemon kept every string a child sent to a phase whole (a string may be
16 MiB) up to 8 Mi characters a tree, and every phase of its 32 finished builds:
filled, each tree held 46 MB with 4-byte characters (about 1.3 GB over 34 kept
trees), and 7.5 MB with short names (255 MB), though ``build.status`` never shows
more than 256 phases of a build, each string cut to 128 bytes.  Now a phase's name
and thread are kept as ``build.status`` shows them, a long id is cut with a digest
of the whole, the text bound is 2 Mi characters, and a finished build keeps only the
phases a reply can show."""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import pytest

from inferd.alerts.sanitise import escaped
from inferd.engine_build import build_record
from inferd.engine_build.events import (
    MAX_PHASE_TEXT,
    MAX_PHASES,
    PHASE_ID_CHARS,
    PHASE_TEXT_BYTES,
    BuildEvent,
    PhaseTree,
)
from inferd.engine_build.status_view import (
    REPLY_BYTES,
    STATUS_DEPTH,
    STATUS_PHASES,
    brief,
    keep_shown,
    with_phases,
)

#: A character of 4 bytes in UTF-8, and 4 bytes in a Python string too.
WIDE = "\U0001f600"


def _event(
    seq: int,
    type_: str,
    phase: str,
    parent: str | None = None,
    name: str = "Timing node",
    thread: str = "t",
    detail: dict[str, Any] | None = None,
) -> BuildEvent:
    return BuildEvent(
        "b1-000000", seq, type_, phase, parent, name, 0, 1,
        time.monotonic_ns(), time.time_ns(), thread, "none", detail or {},
    )  # fmt: skip


def _daemons() -> PhaseTree:
    """A build's tree as the daemon makes it (``Build.tree``)."""
    return build_record.Build.__dataclass_fields__["tree"].default_factory()  # type: ignore[misc, no-any-return]


def test_a_phases_name_and_thread_are_kept_as_build_status_shows_them() -> None:
    name, thread, mode = "\u00e9" * 1000, WIDE * 1000, "x" * 2**20
    tree = _daemons()
    assert tree.apply(_event(1, "phase_start", "p1", None, name, thread, {"timingCacheMode": mode}))
    node = tree.nodes["p1"]
    assert node.name == escaped(name, PHASE_TEXT_BYTES)  # 64 of them, " [cut: 1000 characters]"
    assert node.thread == escaped(thread, PHASE_TEXT_BYTES)
    assert node.name.endswith(" [cut: 1000 characters]")  # the length as sent
    assert tree.timing_cache_start == escaped(mode, PHASE_TEXT_BYTES)
    # build.status shows what it showed before (the note keeps the length as sent).
    (root,) = with_phases(tree, REPLY_BYTES)["roots"]
    assert (root["name"], root["thread"]) == (node.name, node.thread)
    assert brief(tree)["activePath"] == [node.name]
    # Short ASCII text is kept as it came, and a child's own tree keeps every string whole.
    assert tree.apply(_event(2, "phase_start", "p2", "p1", "Timing node", "trt"))
    assert (tree.nodes["p2"].name, tree.nodes["p2"].thread) == ("Timing node", "trt")
    own = PhaseTree()
    assert own.apply(_event(1, "phase_start", "p1", None, name, thread))
    assert (own.nodes["p1"].name, own.nodes["p1"].thread) == (name, thread)


def test_long_ids_are_cut_distinct_their_links_resolve_and_a_collision_is_refused() -> None:
    tree = _daemons()
    first, second = "x" * 999 + "a", "x" * 999 + "b"  # the same but for their last character
    assert tree.apply(_event(1, "phase_start", first))
    assert tree.apply(_event(2, "phase_start", second))
    assert tree.apply(_event(3, "phase_start", "c1", first))
    assert tree.apply(_event(4, "phase_start", WIDE * 500, second))  # a long child of a long one
    kept_first, kept_second = tree.kept_id(first), tree.kept_id(second)
    assert kept_first is not None and kept_second is not None and kept_first != kept_second
    assert len(kept_first) == PHASE_ID_CHARS and kept_first.startswith("x" * 40)
    assert tree.roots == [kept_first, kept_second]
    assert tree.nodes[kept_first].children == ["c1"]
    assert tree.nodes[kept_second].children == [tree.kept_id(WIDE * 500)]
    assert tree.nodes["c1"].parent_id == kept_first
    assert all(len(phase_id) <= PHASE_ID_CHARS for phase_id in tree.nodes)
    # A step and a finish naming the id as sent reach its node.
    assert tree.apply(_event(5, "step", second)) and tree.apply(_event(6, "phase_finish", second))
    assert tree.nodes[kept_second].status == "finished"
    assert tree.nodes[kept_first].status == "running"
    # An id sent as another's cut form, or a long one under itself: refused as a cycle,
    # never merged into the node that has it.
    assert not tree.apply(_event(7, "phase_start", kept_first, None, "impostor"))
    assert not tree.apply(_event(8, "phase_start", "y" * 999, "y" * 999))
    assert (tree.refused, tree.refusal, tree.dropped) == (2, "cycle", 0)
    assert len(tree.nodes) == 4 and tree.nodes[kept_first].name == "Timing node"
    # A tree that cuts nothing keys the ids as sent.
    assert PhaseTree().kept_id(first) == first


def _filled(name: str) -> PhaseTree:
    """A finished tree of 1,200 phases: a root, a chain 30 deep under it (deeper than
    ``STATUS_DEPTH``), and the rest flat under the chain's links; each name ``name``."""
    tree = _daemons()
    tree.apply(_event(0, "phase_start", "root", None, name))
    for seq in range(1, 1200):
        parent = f"p{seq - 1}" if 1 < seq <= 30 else "root" if seq == 1 else f"p{seq % 30}"
        tree.apply(_event(seq, "phase_start", f"p{seq}", parent, f"{name} {seq}"))
        if seq % 3:  # some finish, the others are cut short by the end
            tree.apply(_event(seq, "phase_finish", f"p{seq}"))
    tree.end("failed", time.monotonic_ns())
    return tree


@pytest.mark.parametrize(
    "name", ["Timing node", "\u00e9" * 300], ids=["short: 256 phases", "long: the bytes"]
)
def test_a_finished_tree_keeps_only_what_build_status_shows_and_shows_the_same(
    name: str,
) -> None:
    tree = _filled(name)
    rooms = [REPLY_BYTES, REPLY_BYTES - 2_000, 30_000, 8_000, 1_000, 100]
    before = [with_phases(tree, room) for room in rooms]
    assert before[0]["omittedPhases"] > 0 and max(_depths(before[0])) == STATUS_DEPTH
    keep_shown(tree)
    assert len(tree.nodes) <= STATUS_PHASES and tree.phases == 1200
    assert tree.forgotten == 1200 - len(tree.nodes)
    assert [with_phases(tree, room) for room in rooms] == before
    assert brief(tree)["phases"] == 1200


def _depths(view: dict[str, Any]) -> list[int]:
    depths: list[int] = []

    def walk(node: dict[str, Any], depth: int) -> None:
        depths.append(depth)
        for child in node["children"]:
            walk(child, depth + 1)

    for root in view["roots"]:
        walk(root, 1)
    return depths


#: The memory test fills a tree of an eighth of both bounds: what a phase holds is the
#: same (its node, its strings, its share of the dict, a power of two either way).
_SCALE = 8


@pytest.mark.parametrize(
    ("id_chars", "text_chars"),
    [(PHASE_ID_CHARS - 5, PHASE_TEXT_BYTES // 4), (1000, 1000)],
    ids=["both bounds", "1000 characters each"],
)
def test_a_full_tree_holds_under_18_mb_and_once_finished_under_half_a_mb(
    id_chars: int, text_chars: int
) -> None:
    """The worst case (``both bounds``): ``MAX_PHASES`` phases of ``MAX_PHASE_TEXT``
    characters, all 4 bytes (an id of ``PHASE_ID_CHARS``, a name and a thread of 32:
    128 bytes each), and steps too large for Python's small ints; and strings as long
    as a child likes (46 MB a tree before).  Measured on an eighth of both bounds (the
    whole took 2 s of CPU under tracemalloc, this 0.2 s)."""
    assert MAX_PHASE_TEXT // MAX_PHASES == PHASE_ID_CHARS + 2 * (PHASE_TEXT_BYTES // 4)
    phases = MAX_PHASES // _SCALE
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tree = _daemons()
        tree.max_phases, tree.max_text = phases, MAX_PHASE_TEXT // _SCALE
        for seq in range(phases + 10):  # each event made as the pipe's decoder makes it
            phase, text = f"{seq:05d}{WIDE * id_chars}", WIDE * text_chars
            start = _event(seq, "phase_start", phase, None, text, WIDE * text_chars)
            tree.apply(start)
            tree.apply(BuildEvent(**{**vars(start), "type": "step", "step": 2**40 + seq}))
        tree.end("failed", time.monotonic_ns())
        running = tracemalloc.get_traced_memory()[0] - base
        keep_shown(tree)
        finished = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert running * _SCALE < 18_000_000, f"a full tree holds {running * _SCALE:,} bytes"
    assert finished < 500_000, f"a finished tree holds {finished:,} bytes"
    if id_chars < PHASE_ID_CHARS:
        assert (tree.phases, tree.text) == (phases, MAX_PHASE_TEXT // _SCALE)
