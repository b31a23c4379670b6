"""What ``build.status`` shows of builds, within the reply an operator reads.

``OperatorClient`` refuses a control reply over ``protocol.MAX_HEADER_BYTES``
(64 KiB): the connection ends and ``inferctl`` says UNREACHABLE.  Every listed
build carried its whole phase tree (about 110 bytes a phase; the simulated builder
makes one per ONNX node), so the listing passed 64 KiB at 25 builds of the demo
model, and one build of a 470-node model did alone (review G, F1).  So:

* the listing (no ``build_id``) gives each build its tree's ``brief``: ``state``,
  ``activePath``, ``phases``, ``stalls``, no ``roots``; when even those do not fit
  ``REPLY_BYTES`` the oldest finished builds are left out (``listing``, counted in
  ``builds_omitted``; ``build.status ID`` still answers for each);
* one build (``build_id``) gives ``with_phases``: at most ``STATUS_PHASES`` phases,
  running and newest first, each with its ancestors, no deeper than
  ``STATUS_DEPTH``, within what is left of ``REPLY_BYTES`` after the rest of the
  build's entry, and ``omittedPhases``;
* a phase's ``id``, ``name`` and ``thread`` are cut to ``PHASE_TEXT_BYTES`` of UTF-8
  and ``activePath`` to ``ACTIVE_PATH_NAMES`` names (``alerts.sanitise.escaped``; the
  daemon's tree keeps names and threads so cut already, and ids of at most
  ``events.PHASE_ID_CHARS`` characters);
* a finished build's tree keeps only the phases ``with_phases`` can show
  (``keep_shown``; measured 0.27 MB at most, where the 32 finished builds kept
  with every phase held 8.8 MB each with TensorRT-like names at ``MAX_PHASES``).

Sizes are counted as the bus packs the reply (``protocol.pack``), so a result
is at most ``REPLY_BYTES`` however large the tree or the strings a child sent;
the reply's envelope (``v``, an ``id`` of at most 128 characters, ``ok``,
``result``: ``protocol.ok_header``) adds at most 533 bytes: 57,877 in all, 7,659
under the 65,536 a client reads.  A build's entry without its phases is at most
about 36 KB (measured with every string its child sent a megabyte, every path
4,096 bytes and 16 active-path names of 4-byte characters): one build's result
always holds its entry, and a listing at least one build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from inferd.alerts.sanitise import recut
from inferd.engine_build.events import PHASE_TEXT_BYTES, PhaseNode, PhaseTree
from inferd_wire.protocol import pack

#: The most a ``build.status`` result takes, packed (of the 64 KiB a client reads).
REPLY_BYTES = 56 * 1024
#: Phases one build's ``phase_tree`` lists (``omittedPhases`` counts the rest).
STATUS_PHASES = 256
#: Levels of phases listed (two msgpack levels each: a map and its children).
STATUS_DEPTH = 16
# Bytes of UTF-8 of a phase's ``id``, ``name`` and ``thread`` shown: ``PHASE_TEXT_BYTES``
# (imported from ``events``, where the daemon's tree cuts names and threads to it).
#: Names ``activePath`` shows, from the root.
ACTIVE_PATH_NAMES = 16
#: What a node's ``children`` array header grows by past 15 children (fixarray to
#: array 16; ``STATUS_PHASES`` children never need array 32).
_ARRAY_GROWTH = 2
#: The widest msgpack uint: what ``omittedPhases`` and ``builds_omitted`` take at most.
_WIDEST_UINT = 2**64 - 1


def packed_size(value: Any) -> int:
    """Bytes ``value`` takes in a reply."""
    return len(pack(value))


def _text(value: str) -> str:
    """``value`` as shown: ``escaped`` already (the daemon's tree cut it as it came,
    note and all: ``recut`` keeps its note and so its length as sent) or not yet."""
    return recut(value, PHASE_TEXT_BYTES)


def brief(tree: PhaseTree) -> dict[str, Any]:
    """The tree's state and counts, without its phases (the listing's)."""
    path = tree.active_path()[:ACTIVE_PATH_NAMES]
    return {
        "state": tree.state,
        "activePath": [_text(name) for name in path],
        "phases": tree.phases,
        "stalls": tree.stalls,
    }


def one_build(entry: dict[str, Any], tree: PhaseTree) -> dict[str, Any]:
    """A build's ``build.status`` entry (its ``phase_tree`` a ``brief``) with as
    many of ``tree``'s phases as keep the result, ``{build: entry}``, within
    ``REPLY_BYTES``."""
    rest = packed_size({"build": entry}) - packed_size(entry["phase_tree"])
    return {**entry, "phase_tree": with_phases(tree, REPLY_BYTES - rest)}


def listing_reply(entries: Sequence[dict[str, Any]], rest: Mapping[str, Any]) -> dict[str, Any]:
    """The ``build.status`` listing of ``entries`` (oldest first, each with its
    tree's ``brief``) and ``rest``, within ``REPLY_BYTES``."""
    room = REPLY_BYTES - packed_size({**rest, "builds": [], "builds_omitted": _WIDEST_UINT})
    kept, omitted = listing(entries, room)
    return {"builds": kept, "builds_omitted": omitted, **rest}


def with_phases(tree: PhaseTree, room: int) -> dict[str, Any]:
    """``brief`` and ``roots``: the phases that fit ``room`` bytes packed (and
    ``STATUS_PHASES``), ``omittedPhases`` the count of the others."""
    head = brief(tree)
    keys = packed_size({"roots": [], "omittedPhases": _WIDEST_UINT}) + 2  # + array 16
    budget = room - packed_size(head) - keys
    shown = _chosen(tree, budget)

    def node(phase_id: str) -> dict[str, Any]:
        children = [node(child) for child in tree.nodes[phase_id].children if child in shown]
        return {**_fields(tree, tree.nodes[phase_id]), "children": children}

    roots = [node(root) for root in tree.roots if root in shown]
    return {**head, "roots": roots, "omittedPhases": tree.phases - len(shown)}


def keep_shown(tree: PhaseTree) -> None:
    """A finished build's ``tree`` (no phase running) keeps only the phases
    ``with_phases`` can show of it: those ``_chosen`` picks with the most room a reply
    has.  Any later reply, with less room, shows the same: ``_chosen`` walks the same
    phases in the same order with the same costs (every phase it passes before it
    stops is kept, with its ancestors), and so stops at the same one."""
    tree.keep_only(_chosen(tree, REPLY_BYTES))


def _fields(tree: PhaseTree, node: PhaseNode) -> dict[str, Any]:
    fields = tree.fields(node)
    for key in ("id", "name", "thread"):
        fields[key] = _text(fields[key])
    return fields


def _chosen(tree: PhaseTree, budget: int) -> set[str]:
    """The phases shown: running first, then the newest, each with its ancestors,
    until the next would pass ``budget`` bytes or ``STATUS_PHASES``."""
    parent_of = {child: pid for pid, node in tree.nodes.items() for child in node.children}
    order = sorted(tree.nodes.values(), key=lambda n: (n.status != "running", -n.started_ns))
    shown: set[str] = set()
    spent = 0
    for candidate in order:
        chain = _unshown_line(candidate.phase_id, parent_of, shown)
        if chain is None:  # deeper than STATUS_DEPTH
            continue
        cost = sum(
            packed_size({**_fields(tree, tree.nodes[i]), "children": []}) + _ARRAY_GROWTH
            for i in chain
        )
        if len(shown) + len(chain) > STATUS_PHASES or spent + cost > budget:
            break
        shown.update(chain)
        spent += cost
    return shown


def _unshown_line(phase_id: str, parent_of: Mapping[str, str], shown: set[str]) -> list[str] | None:
    """``phase_id`` and its ancestors not shown yet; None when it lies deeper than
    ``STATUS_DEPTH`` (or, defence in depth, on a cycle)."""
    line: list[str] = []
    current: str | None = phase_id
    for _ in range(STATUS_DEPTH):
        if current is None:
            break
        if current not in shown:
            line.append(current)
        current = parent_of.get(current)
    else:
        if current is not None:
            return None
    return line


def listing(entries: Sequence[dict[str, Any]], room: int) -> tuple[list[dict[str, Any]], int]:
    """The builds that fit ``room`` bytes packed, and how many were left out: the
    oldest finished ones first, then the oldest running (``entries`` oldest first)."""
    sizes = [packed_size(entry) for entry in entries]
    total = 3 + sum(sizes)  # an array 16 header
    dropped: set[int] = set()
    finished_first = sorted(range(len(entries)), key=lambda i: entries[i]["state"] == "running")
    for index in finished_first:
        if total <= room:
            break
        dropped.add(index)
        total -= sizes[index]
    kept = [entry for index, entry in enumerate(entries) if index not in dropped]
    return kept, len(dropped)
