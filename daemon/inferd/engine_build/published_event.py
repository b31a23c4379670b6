"""A build child's event as the daemon publishes it on the ``build`` topic: made
from what the daemon kept of it, never from the child's strings whole.

A child may send strings of up to 16 MiB (``pipe.MAX_MESSAGE_BYTES``): a model's
layer names become its phases' names.  Published whole, one subscriber that stops
reading made the daemon hold 250 MB over three builds (the bound on its queue,
``SUBSCRIBER_SNDHWM``, counts events, not bytes), and every event over a client's
64 KiB (``inferd_wire.topics.MAX_EVENT_BYTES``) ended that client's connection,
so ``inferctl build follow`` never saw the build end.  So the published event has

* ``phaseId`` and ``parentId`` as the tree keys them (``PhaseTree.kept_id``),
  ``name`` and ``thread`` cut to ``PHASE_TEXT_BYTES``, as ``build.status`` shows them;
* in ``detail`` only the keys the daemon's own child sends, each of its type: the
  first event's ``timingCacheMode`` (a word a build starts with), a cancel's
  ``source`` and ``reason`` (cut as ``build.status`` shows a child's words) and
  ``inNoCancelZone``, a stall's numbers and its path as the daemon's tree has it
  (``activePath``); any other key is left out;

and a ``step`` or ``phase_finish`` of a phase the tree did not keep (past its
bounds: ``build.status``'s ``phases_dropped``) is not published: it names no phase
a subscriber was told of.
"""

from __future__ import annotations

import math
from typing import Any

from inferd.engine_build.build_record import START_MODES, Build, said
from inferd.engine_build.events import BuildEvent, PhaseTree
from inferd.engine_build.status_view import brief

#: A stall's numbers (``progress.StallWatchdog``): the seconds kind and the counts.
_STALL_SECONDS = ("idleS", "nextAfterS")
_STALL_COUNTS = ("depth", "inARow")


def published(build: Build, event: BuildEvent) -> dict[str, Any] | None:
    """``event``, which ``build.tree`` took, in ``BuildEvent.as_dict`` form as the
    ``build`` topic carries it; None when it is not published (a phase the tree
    did not keep).  The caller holds ``build.lock``."""
    tree = build.tree
    phase_id = tree.kept_id(event.phase_id)
    if event.type in ("step", "phase_finish") and phase_id not in tree.nodes:
        return None
    node = tree.nodes.get(phase_id) if phase_id is not None else None
    name = node.name if node is not None else _cut(tree, event.name)
    data = event.as_dict()
    data.update(
        phaseId=phase_id,
        parentId=tree.kept_id(event.parent_id),
        name=name,
        thread=_cut(tree, event.thread),
    )
    data.pop("detail", None)
    detail = _detail(build, event)
    if detail:
        data["detail"] = detail
    return data


def _cut(tree: PhaseTree, text: str | None) -> str | None:
    """``text`` as ``build.status`` shows a phase's strings."""
    return None if text is None else tree.kept_text(text)


def _detail(build: Build, event: BuildEvent) -> dict[str, Any]:
    sent = event.detail
    detail: dict[str, Any] = {}
    if sent.get("timingCacheMode") in START_MODES:
        detail["timingCacheMode"] = sent["timingCacheMode"]
    if event.type == "cancel_requested":
        for key in ("source", "reason"):
            if isinstance(sent.get(key), str):
                detail[key] = said(sent[key])
        if isinstance(sent.get("inNoCancelZone"), bool):
            detail["inNoCancelZone"] = sent["inNoCancelZone"]
    elif event.type == "stalled":
        detail["path"] = brief(build.tree)["activePath"]
        for key in (*_STALL_SECONDS, *_STALL_COUNTS):
            value = sent.get(key)
            kinds = (int, float) if key in _STALL_SECONDS else (int,)
            if not isinstance(value, kinds) or isinstance(value, bool):
                continue
            if math.isfinite(value) and value >= 0:
                detail[key] = value
    return detail
