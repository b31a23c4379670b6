"""The progress-monitor adapter: TensorRT ``IProgressMonitor`` callbacks -> events.

``ProgressAdapter`` implements the three callback names (``phase_start``,
``step_complete``, ``phase_finish``) as plain methods, so the simulated builder
and the real one drive the same code; ``make_trt_progress_monitor`` wraps it in
a lazily defined ``trt.IProgressMonitor`` subclass for ``IBuilderConfig``.

Callbacks come from several builder threads.  Each one takes a short lock
(no I/O, no waiting on consumers; reentrant, since a signal handler's cancel
emits ``cancel_requested`` on the main thread, which may hold it), updates the
adapter's own phase tree and puts an event into the bounded ``EventQueue``; a
full queue drops the event (counted).  No exception ever escapes into TensorRT:
``step_complete`` answers ``not token.is_set()`` whatever happens.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from inferd.engine_build.cancel import CancellationToken, CancelRequest
from inferd.engine_build.events import BuildEvent, EventQueue, PhaseTree, now_ns


class ProgressAdapter:
    def __init__(
        self,
        build_id: str,
        token: CancellationToken,
        *,
        queue: EventQueue | None = None,
        listener: Callable[[BuildEvent], None] | None = None,
    ) -> None:
        self.build_id = build_id
        self.token = token
        self.queue = queue if queue is not None else EventQueue()
        self.tree = PhaseTree()
        self.listener = listener
        self.callback_errors = 0
        self.unknown_finishes = 0
        self.first_false_ns: int | None = None
        self._lock = threading.RLock()
        self._seq = itertools.count(1)  # one step even for an emit a signal handler nests
        self._next_phase = 0
        self._active: dict[str, str] = {}  # phase name -> phase id (names are unique while active)
        self._for_next: dict[str, Any] | None = None  # ``attach_to_next``'s facts
        self.last_event_mono_ns = time.monotonic_ns()
        token.add_listener(self._on_cancel)

    # -- event plumbing ---------------------------------------------------------------
    def emit(
        self,
        type_: str,
        *,
        phase_id: str | None = None,
        parent_id: str | None = None,
        name: str | None = None,
        step: int | None = None,
        num_steps: int | None = None,
        detail: dict[str, Any] | None = None,
        progress: bool = True,
    ) -> BuildEvent:
        mono, wall = now_ns()
        with self._lock:
            if self._for_next is not None:  # the event's own facts win
                detail, self._for_next = {**self._for_next, **(detail or {})}, None
            event = BuildEvent(
                build_id=self.build_id,
                seq=next(self._seq),
                type=type_,
                phase_id=phase_id,
                parent_id=parent_id,
                name=name,
                step=step,
                num_steps=num_steps,
                mono_ns=mono,
                wall_ns=wall,
                thread=threading.current_thread().name,
                cancel_state=self.token.state(),
                detail=detail or {},
            )
            self.tree.apply(event)
            if progress:
                self.last_event_mono_ns = mono
        self.queue.put(event)
        if self.listener is not None:
            try:
                self.listener(event)
            except Exception:
                self.callback_errors += 1
        return event

    def attach_to_next(self, detail: dict[str, Any]) -> None:
        """Facts the build knows before its builder reports anything (the timing-cache
        decision it starts with): carried by its next event, whatever its type (as a
        rule the first phase's start), so a follower sees them while the build runs."""
        with self._lock:
            self._for_next = dict(detail)

    def _on_cancel(self, request: CancelRequest) -> None:
        self.emit(
            "cancel_requested",
            detail={
                "source": request.source,
                "reason": request.reason,
                "inNoCancelZone": request.in_no_cancel_zone,
            },
            progress=False,
        )

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            snap = self.tree.snapshot()
        snap["droppedEvents"] = self.queue.dropped
        return snap

    def active_path(self) -> list[str]:
        with self._lock:
            return self.tree.active_path()

    # -- IProgressMonitor -------------------------------------------------------------
    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
        try:
            with self._lock:
                self._next_phase += 1
                phase_id = f"p{self._next_phase}"
                parent_id = self._active.get(parent_phase) if parent_phase else None
                self._active[phase_name] = phase_id
            self.emit(
                "phase_start",
                phase_id=phase_id,
                parent_id=parent_id,
                name=phase_name,
                step=0,
                num_steps=int(num_steps),
            )
        except Exception:
            self.callback_errors += 1

    def step_complete(self, phase_name: str, step: int) -> bool:
        try:
            with self._lock:
                phase_id = self._active.get(phase_name)
            self.emit("step", phase_id=phase_id, name=phase_name, step=int(step))
        except Exception:
            self.callback_errors += 1
        if self.token.is_set():
            if self.first_false_ns is None:
                self.first_false_ns = time.monotonic_ns()
            return False
        return True

    def phase_finish(self, phase_name: str) -> None:
        try:
            with self._lock:
                phase_id = self._active.pop(phase_name, None)
            if phase_id is None:
                self.unknown_finishes += 1
            self.emit("phase_finish", phase_id=phase_id, name=phase_name)
        except Exception:
            self.callback_errors += 1


def make_trt_progress_monitor(adapter: ProgressAdapter, trt: Any) -> Any:
    """A ``trt.IProgressMonitor`` forwarding to ``adapter`` (class defined lazily,
    so importing this module never needs TensorRT)."""

    class _Monitor(trt.IProgressMonitor):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.adapter = adapter

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            adapter.phase_start(phase_name, parent_phase, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            return adapter.step_complete(phase_name, step)

        def phase_finish(self, phase_name: str) -> None:
            adapter.phase_finish(phase_name)

    return _Monitor()


class StallWatchdog:
    """No progress event for ``stall_after_s`` -> a ``stalled`` event naming the
    current phase path and depth; repeated with back-off (x``backoff``, capped at
    ``max_interval_s``).  Cancels (source ``stall``) only if ``cancel_after_stalls``,
    once that many stalls came in a row (``inARow``: no progress event between): a
    build whose slow tactics each end before the next stall is not cancelled for
    the stalls it had over hours."""

    def __init__(
        self,
        adapter: ProgressAdapter,
        stall_after_s: float,
        *,
        backoff: float = 2.0,
        max_interval_s: float = 300.0,
        cancel_after_stalls: int | None = None,
    ) -> None:
        if stall_after_s <= 0:
            raise ValueError("stall_after_s must be positive")
        self.adapter = adapter
        self.stall_after_s = stall_after_s
        self.backoff = backoff
        self.max_interval_s = max_interval_s
        self.cancel_after_stalls = cancel_after_stalls
        self.stalls: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="build-stall-watchdog", daemon=True)

    def start(self) -> StallWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        poll = min(0.05, self.stall_after_s / 4)
        interval = self.stall_after_s
        seen = self.adapter.last_event_mono_ns
        while not self._stop.wait(poll):
            last = self.adapter.last_event_mono_ns
            if last != seen:
                seen, interval = last, self.stall_after_s
                continue
            idle_s = (time.monotonic_ns() - last) / 1e9
            # This silence's stalls, this one included
            in_a_row = sum(1 for s in self.stalls if s["sinceNs"] == last) + 1
            threshold = sum(
                min(self.stall_after_s * self.backoff**i, self.max_interval_s)
                for i in range(in_a_row)
            )
            if idle_s < threshold:
                continue
            path = self.adapter.active_path()
            record = {
                "path": path,
                "depth": len(path),
                "idleS": round(idle_s, 3),
                "nextAfterS": round(min(interval * self.backoff, self.max_interval_s), 3),
                "inARow": in_a_row,
                "sinceNs": last,
            }
            self.stalls.append(record)
            interval = min(interval * self.backoff, self.max_interval_s)
            self.adapter.emit(
                "stalled",
                name=path[-1] if path else None,
                detail={k: v for k, v in record.items() if k != "sinceNs"},
                progress=False,
            )
            if self.cancel_after_stalls is not None and in_a_row >= self.cancel_after_stalls:
                self.adapter.token.cancel("stall", f"no progress for {idle_s:.1f}s at {path}")
