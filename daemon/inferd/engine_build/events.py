"""Build progress events and the phase tree rebuilt from them.

A build is a tree of phases.  ``BuildEvent`` is one thing that happened
(``phase_start``, ``step``, ``phase_finish``, ``stalled``, ``cancel_requested``,
``cancelled``, ``completed``, ``failed``); ``PhaseTree`` folds events into a
snapshot; ``EventQueue`` is the bounded, never-blocking hand-off from builder
threads to consumers (a full queue drops the event and counts it).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from inferd.alerts.sanitise import escaped

EventType = Literal[
    "phase_start",
    "step",
    "phase_finish",
    "stalled",
    "cancel_requested",
    "cancelled",
    "completed",
    "failed",
]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)
TERMINAL_EVENTS = frozenset({"cancelled", "completed", "failed"})


def now_ns() -> tuple[int, int]:
    """(monotonic ns, wall-clock ns)."""
    return time.monotonic_ns(), time.time_ns()


@dataclass(frozen=True)
class BuildEvent:
    build_id: str
    seq: int
    type: str
    phase_id: str | None
    parent_id: str | None
    name: str | None
    step: int | None
    num_steps: int | None
    mono_ns: int
    wall_ns: int
    thread: str
    cancel_state: str
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "buildId": self.build_id,
            "seq": self.seq,
            "type": self.type,
            "phaseId": self.phase_id,
            "parentId": self.parent_id,
            "name": self.name,
            "step": self.step,
            "numSteps": self.num_steps,
            "monotonicNs": self.mono_ns,
            "wallNs": self.wall_ns,
            "thread": self.thread,
            "cancelState": self.cancel_state,
            **({"detail": self.detail} if self.detail else {}),
        }


class EventQueue:
    """Bounded FIFO that never blocks a producer: when full, the new event is
    dropped and counted (``dropped``).  Consumers ``drain()``."""

    def __init__(self, maxsize: int = 4096) -> None:
        if maxsize <= 0:
            raise ValueError("maxsize must be positive")
        self.maxsize = maxsize
        self._items: deque[BuildEvent] = deque()
        self._lock = threading.RLock()  # a signal handler's cancel may put while it is held
        self.dropped = 0
        self.accepted = 0

    def put(self, event: BuildEvent) -> bool:
        with self._lock:
            if len(self._items) >= self.maxsize:
                self.dropped += 1
                return False
            self._items.append(event)
            self.accepted += 1
            return True

    def drain(self, limit: int | None = None) -> list[BuildEvent]:
        with self._lock:
            count = len(self._items) if limit is None else min(limit, len(self._items))
            return [self._items.popleft() for _ in range(count)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


@dataclass(slots=True)  # 48 bytes a phase less: the daemon keeps up to MAX_PHASES of each
class PhaseNode:
    phase_id: str
    name: str
    parent_id: str | None
    num_steps: int
    started_ns: int
    thread: str
    step: int | None = None
    finished_ns: int | None = None
    status: str = "running"  # running | finished | finished_early
    children: list[str] = field(default_factory=list)

    @property
    def completed(self) -> int:
        """Steps reported complete (``step`` is the last index reported)."""
        return 0 if self.step is None else self.step + 1


#: Phases the daemon keeps of one running build (``build_record.Build.tree``; a child
#: can send any number; a finished build's tree keeps only what ``build.status`` shows:
#: ``status_view.keep_shown``).  The simulated builder makes one per ONNX node (a
#: detection model a few hundred, a large transformer about ten thousand), a TensorRT
#: build of a large model a few thousand (not measured on a Jetson here).  Measured
#: at 16,384 with names of 90 characters like TensorRT's: 8.8 MB (539 bytes a phase),
#: and ``build.status ID`` (``status_view.with_phases``, which sorts them all under
#: the build's lock) 18 to 40 ms.
MAX_PHASES = 16_384
#: Characters of every kept phase's ``id``, ``name`` and ``thread`` together, each cut
#: first (``PHASE_TEXT_BYTES``, ``PHASE_ID_CHARS``): 128 a phase at ``MAX_PHASES``
#: (TensorRT's layer names run to about a hundred).  A tree filled to both bounds with
#: 4-byte characters (4 bytes each as Python holds them) measured 16.5 MB.
MAX_PHASE_TEXT = 2 * 1024 * 1024
#: Bytes of UTF-8 of a phase's ``name`` and ``thread`` the daemon keeps, cut as
#: ``build.status`` shows them (``alerts.sanitise.escaped``, with its note): a string
#: a child sends may be 16 MiB (``pipe.MAX_MESSAGE_BYTES``).
PHASE_TEXT_BYTES = 128
#: Characters of a phase id (and parent id) the daemon keeps whole: a longer one is
#: cut to this many, ending in a digest of the whole (``PhaseTree.kept_id``).
PHASE_ID_CHARS = 64


class PhaseTree:
    """Phase tree folded from events; ``snapshot()`` is a JSON-able nested view.

    ``max_phases``, ``max_text`` and ``cut`` (None, None, False: unbounded, the child's
    own tree of its builder, ``inferd build``'s) bound what a tree of another
    process's events holds: with ``cut`` each string of a phase is cut as it comes
    (``kept_id``, ``PHASE_TEXT_BYTES``); a ``phase_start`` past either bound is
    dropped and counted (``dropped``), and the events of a dropped phase, which names
    no node, change nothing."""

    def __init__(
        self, max_phases: int | None = None, max_text: int | None = None, *, cut: bool = False
    ) -> None:
        self.nodes: dict[str, PhaseNode] = {}
        self.roots: list[str] = []
        self.state = "running"
        self.stalls = 0
        self.max_phases, self.max_text, self.cut = max_phases, max_text, cut
        #: Characters of the kept phases' ``id``, ``name`` and ``thread`` (``max_text``),
        #: as cut, while the build ran.
        self.text = 0
        #: Phases forgotten once the build ended (``keep_only``), still counted in ``phases``.
        self.forgotten = 0
        #: ``phase_start`` events refused (``apply``): a child's stream gone wrong.
        self.refused = 0
        #: ``phase_start`` events dropped past ``max_phases`` or ``max_text``.
        self.dropped = 0
        #: Why the last event ``apply`` refused was: ``cycle``, ``phases`` or ``text``.
        self.refusal: str | None = None
        self.last_event: str | None = None
        #: The timing-cache decision the build started with (``cold``, ``reused``,
        #: ``quarantined``): the first event that names one carries it (the child's
        #: ``ProgressAdapter.attach_to_next``); None until then.
        self.timing_cache_start: str | None = None

    @classmethod
    def from_events(cls, events: Iterable[BuildEvent]) -> PhaseTree:
        tree = cls()
        for event in events:
            tree.apply(event)
        return tree

    @property
    def phases(self) -> int:
        """Phases the tree took (``forgotten`` ones included)."""
        return len(self.nodes) + self.forgotten

    def apply(self, event: BuildEvent) -> bool:
        """Fold ``event`` in; False when refused (counted in ``refused``): a
        ``phase_start`` of an id the tree has, or naming itself as its parent (ids as
        kept: ``kept_id``).  Its parent is looked up before the node is added, and only
        a new node is ever added as a child, so the tree stays a forest whatever the
        child sends (a cycle made ``active_path`` loop for ever, under ``build.lock``)."""
        phase_id = self.kept_id(event.phase_id)
        node: PhaseNode | None = None
        if event.type == "phase_start" and phase_id is not None:
            parent_id = self.kept_id(event.parent_id)
            if phase_id in self.nodes or parent_id == phase_id:
                self.refused, self.refusal = self.refused + 1, "cycle"
                return False
            full = self.max_phases is not None and len(self.nodes) >= self.max_phases
            if not full:  # a full tree's drops cost no cut
                node = PhaseNode(
                    phase_id=phase_id,
                    name=self.kept_text(event.name or "?"),
                    parent_id=parent_id,
                    num_steps=event.num_steps or 0,
                    started_ns=event.mono_ns,
                    thread=self.kept_text(event.thread),
                )
            if node is None or not self._fits(node):
                self.dropped, self.refusal = self.dropped + 1, "phases" if full else "text"
                return False
        self.last_event = event.type
        if self.timing_cache_start is None and event.detail:
            mode = event.detail.get("timingCacheMode")
            self.timing_cache_start = self.kept_text(mode) if isinstance(mode, str) else None
        if node is not None:
            parent = self.nodes.get(node.parent_id) if node.parent_id else None
            self.nodes[node.phase_id] = node
            if parent is not None:
                node.parent_id = parent.phase_id  # one string for both
                parent.children.append(node.phase_id)
            else:
                # A root: an id naming no phase here is not counted in ``text`` (the
                # daemon's tree links by ``children``; a child's own keeps it).
                node.parent_id = None if self.cut else node.parent_id
                self.roots.append(node.phase_id)
        elif event.type == "step" and phase_id in self.nodes:
            self.nodes[phase_id].step = event.step
        elif event.type == "phase_finish" and phase_id in self.nodes:
            node = self.nodes[phase_id]
            node.finished_ns = event.mono_ns
            node.status = "finished" if node.completed >= node.num_steps else "finished_early"
        elif event.type == "stalled":
            self.stalls += 1
        elif event.type in TERMINAL_EVENTS:
            self.end(event.type, event.mono_ns)
        elif event.type == "cancel_requested" and self.state == "running":
            self.state = "cancel_requested"
        return True

    def kept_id(self, phase_id: str | None) -> str | None:
        """``phase_id`` as the tree keys it: whole, or (``cut``) past ``PHASE_ID_CHARS``
        its start and a digest of the whole, ``PHASE_ID_CHARS`` in all, the same for an
        id and a parent id naming it.  Distinct ids stay distinct: a collision (2**-64
        for two ids) or an id sent as another's cut form is an id the tree has, refused
        as a cycle would be, never merged."""
        if phase_id is None or not self.cut or len(phase_id) <= PHASE_ID_CHARS:
            return phase_id
        whole = phase_id.encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(whole, digest_size=8).hexdigest()
        return f"{phase_id[: PHASE_ID_CHARS - len(digest) - 1]}~{digest}"

    def kept_text(self, text: str) -> str:
        """``text`` as the tree keeps it: whole, or (``cut``) as ``build.status`` shows it."""
        if not self.cut or (len(text) <= PHASE_TEXT_BYTES and text.isascii()):
            return text
        return escaped(text, PHASE_TEXT_BYTES)

    def _fits(self, node: PhaseNode) -> bool:
        """Whether the new ``node``'s text fits ``max_text`` (then it is counted)."""
        text = len(node.phase_id) + len(node.name) + len(node.thread)
        if self.max_text is not None and self.text + text > self.max_text:
            return False
        self.text += text
        return True

    def keep_only(self, kept: Collection[str]) -> None:
        """Forget every phase but ``kept`` (each with its parent kept too: a finished
        build's, ``status_view.keep_shown``), still counted in ``phases``."""
        nodes = {phase_id: node for phase_id, node in self.nodes.items() if phase_id in kept}
        for node in nodes.values():
            node.children = [child for child in node.children if child in kept]
        self.forgotten += len(self.nodes) - len(nodes)
        self.nodes, self.roots = nodes, [root for root in self.roots if root in kept]

    def end(self, state: str, mono_ns: int) -> None:
        """The build ended (``state``): a phase still running was cut short by it (a
        crashed builder never finishes its phases; a killed build process sends
        nothing more), ``finished_early`` at ``mono_ns``; none stays ``running``."""
        self.state = state
        for node in self.nodes.values():
            if node.status == "running":
                node.finished_ns, node.status = max(mono_ns, node.started_ns), "finished_early"

    def active_path(self) -> list[str]:
        """Names from the root to the deepest running phase (most recent branch)."""
        path: list[str] = []
        seen: set[str] = set()  # no node twice, whatever the nodes say
        candidates = self.roots
        while True:
            running = [
                self.nodes[i]
                for i in candidates
                if i not in seen and self.nodes[i].status == "running"
            ]
            if not running:
                return path
            node = max(running, key=lambda n: n.started_ns)
            seen.add(node.phase_id)
            path.append(node.name)
            candidates = node.children

    def fields(self, node: PhaseNode) -> dict[str, Any]:
        """One phase as a snapshot shows it, without its children."""
        return {
            "id": node.phase_id,
            "name": node.name,
            "status": node.status,
            "step": node.step,
            "completedSteps": node.completed,
            "numSteps": node.num_steps,
            "thread": node.thread,
            "durationMs": None
            if node.finished_ns is None
            else round((node.finished_ns - node.started_ns) / 1e6, 3),
        }

    def _node(self, phase_id: str, seen: set[str]) -> dict[str, Any]:
        seen.add(phase_id)
        node = self.nodes[phase_id]
        children = [self._node(child, seen) for child in node.children if child not in seen]
        return {**self.fields(node), "children": children}

    def snapshot(self) -> dict[str, Any]:
        """The whole tree (a build's summary; ``build.status`` shows a bounded
        view of it: ``status_view``)."""
        seen: set[str] = set()
        return {
            "state": self.state,
            "activePath": self.active_path(),
            "phases": len(self.nodes),
            "stalls": self.stalls,
            "roots": [self._node(root, seen) for root in self.roots if root not in seen],
        }

    def render(self) -> str:
        """Indented text view (for reports and terminals)."""
        lines: list[str] = []
        seen: set[str] = set()

        def walk(phase_id: str, depth: int) -> None:
            seen.add(phase_id)
            node = self.nodes[phase_id]
            step = f"{node.completed}/{node.num_steps}"
            lines.append(f"{'  ' * depth}- {node.name} [{node.status} {step}]")
            for child in node.children:
                if child not in seen:
                    walk(child, depth + 1)

        for root in self.roots:
            if root not in seen:
                walk(root, 0)
        return "\n".join(lines)


def render_snapshot(snapshot: dict[str, Any]) -> str:
    """Indented text view of a ``PhaseTree.snapshot()`` (e.g. from a build summary)."""
    lines: list[str] = []

    def walk(node: dict[str, Any], depth: int) -> None:
        done = node.get("completedSteps", 0)
        lines.append(f"{'  ' * depth}- {node['name']} [{node['status']} {done}/{node['numSteps']}]")
        for child in node.get("children", []):
            walk(child, depth + 1)

    for root in snapshot.get("roots", []):
        walk(root, 0)
    return "\n".join(lines)
