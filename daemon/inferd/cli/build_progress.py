"""What ``inferd build`` shows while it builds: a live phase tree on a terminal
(``rich``) or one plain line per phase, and ``--json-log``'s JSON lines.

TensorRT calls the progress monitor on its build thread and waits for it, so
no renderer runs there: ``BuildProgress`` is the listener the build session
calls, and it only queues the event on an ``EventRelay``; the relay's thread
(``inferd-build-renderer``) writes to the terminal and the log.  ``step``
events are dropped when the renderers fall ``_BACKLOG`` events behind
(counted in ``dropped`` and reported); phase boundaries, cancel and the
outcome always arrive.  Phase names and a cancel's source come from the build
(TensorRT, a model's ONNX file): each line shows them through
``inferd_client.cli_format.printable``, never a terminal control.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from inferd.engine_build.relay import EventRelay
from inferd_client.cli_format import printable

if TYPE_CHECKING:
    from inferd.engine_build.events import BuildEvent

#: Step events waiting for the renderers beyond which new ones are dropped.
_BACKLOG = 1024


class PlainProgress:
    """One line per phase start/finish (and cancel / outcome), indented by depth."""

    def __init__(self, stream: TextIO) -> None:
        from inferd.engine_build.events import PhaseTree

        self.stream = stream
        self.tree = PhaseTree()
        self._lock = threading.Lock()

    def _depth(self, phase_id: str | None) -> int:
        depth = 0
        node = self.tree.nodes.get(phase_id) if phase_id else None
        while node is not None and node.parent_id is not None:
            depth += 1
            node = self.tree.nodes.get(node.parent_id)
        return depth

    def __call__(self, event: BuildEvent) -> None:
        with self._lock:
            self.tree.apply(event)
            line: str | None = None
            indent = "  " * self._depth(event.phase_id)
            if event.type == "phase_start":
                line = f"start     {indent}{event.name} ({event.num_steps} steps)"
            elif event.type == "phase_finish":
                node = self.tree.nodes.get(event.phase_id or "")
                state = (
                    "" if node is None else f" [{node.status} {node.completed}/{node.num_steps}]"
                )
                line = f"finish    {indent}{event.name}{state}"
            elif event.type == "cancel_requested":
                line = f"cancel    requested by {event.detail.get('source')}"
            elif event.type == "stalled":
                line = f"stalled   {' > '.join(event.detail.get('path', []))}"
            start = event.detail.get("timingCacheMode") if event.detail else None
            if line is not None and start is not None:  # the build's first event carries it
                line += f"  (timing cache at start: {start})"
            if line is not None:
                self.stream.write(printable(line) + "\n")
                self.stream.flush()

    def close(self) -> None:
        pass


class LiveProgress:
    """A live nested phase tree on a terminal (``rich``), refreshed from events."""

    _STYLE = {"running": "yellow", "finished": "green", "finished_early": "cyan"}

    def __init__(self, stream: TextIO, title: str) -> None:
        from rich.console import Console
        from rich.live import Live

        from inferd.engine_build.events import PhaseTree

        self.tree = PhaseTree()
        self.title = title
        self._lock = threading.Lock()
        self.live = Live(
            console=Console(file=stream),
            get_renderable=self._render,
            refresh_per_second=8,
            redirect_stdout=False,
            # Log lines (written to the current sys.stderr) print above the tree.
            redirect_stderr=True,
        )
        self.live.start()

    def __call__(self, event: BuildEvent) -> None:
        with self._lock:
            self.tree.apply(event)

    def _render(self) -> Any:
        from rich.text import Text
        from rich.tree import Tree

        with self._lock:
            snapshot = self.tree.snapshot()
            start = self.tree.timing_cache_start
        cache = "" if start is None else f"  timing cache at start: {start}"
        root = Tree(Text(printable(f"{self.title}  [{snapshot['state']}]{cache}"), style="bold"))

        def add(parent: Any, node: dict[str, Any]) -> None:
            label = Text(printable(f"{node['name']}  "), style=self._STYLE.get(node["status"], ""))
            label.append(f"{node['completedSteps']}/{node['numSteps']}  {node['status']}")
            if node["durationMs"] is not None:
                label.append(f"  {node['durationMs'] / 1000:.1f} s", style="dim")
            branch = parent.add(label)
            for child in node["children"]:
                add(branch, child)

        for node in snapshot["roots"]:
            add(root, node)
        return root

    def close(self) -> None:
        self.live.refresh()
        self.live.stop()


def progress_display(stream: TextIO, title: str) -> PlainProgress | LiveProgress:
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        try:
            return LiveProgress(stream, title)
        except ImportError:
            pass
    return PlainProgress(stream)


class JsonLog:
    """Every build event as one JSON line (flushed per line)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self.last_seq = 0

    def __call__(self, event: BuildEvent) -> None:
        with self._lock:
            if self._file.closed:
                return
            self.last_seq = max(self.last_seq, event.seq)
            self._file.write(json.dumps(event.as_dict(), sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class BuildProgress:
    """The listener of one build: queues events for the renderer thread."""

    def __init__(self, stream: TextIO, title: str, json_log_path: Path | None) -> None:
        self.display = progress_display(stream, title)
        self.json_log = JsonLog(json_log_path) if json_log_path is not None else None
        self._sinks: list[Callable[[BuildEvent], None]] = [self.display]
        if self.json_log is not None:
            self._sinks.append(self.json_log)
        self._relay: EventRelay[BuildEvent] = EventRelay(
            self._render, capacity=_BACKLOG, name="inferd-build-renderer"
        )

    def __call__(self, event: BuildEvent) -> None:
        """Called on TensorRT's build thread: never blocks, never writes."""
        if event.type == "step":
            self._relay.offer(event)
        else:
            self._relay.put(event)

    @property
    def dropped(self) -> int:
        """Step events not shown because the renderers fell behind."""
        return self._relay.dropped

    def _render(self, event: BuildEvent) -> None:
        for sink in self._sinks:
            with contextlib.suppress(Exception):  # one broken sink must not starve the other
                sink(event)

    def stop_rendering(self, timeout: float | None = None) -> None:
        """Render everything queued (waiting at most ``timeout`` s); the display and
        the log stay open."""
        self._relay.close(timeout)

    def close(self, timeout: float | None = None) -> None:
        """``stop_rendering``, then close the display and the log."""
        self.stop_rendering(timeout)
        for sink in (self.display, self.json_log):
            if sink is not None:
                with contextlib.suppress(Exception):
                    sink.close()
