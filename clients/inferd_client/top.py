"""``inferctl top``: a live terminal view of a running daemon.

Every ``--interval`` seconds it asks the control socket for ``status`` and
``build.status``; between polls it reads the events socket (``alert``,
``build``, ``runtime``), so alerts and build progress show as they happen.
Request rates are the difference of two ``status`` snapshots over the time
between them.  A daemon that does not answer is shown as unreachable and asked
again at the next interval; ``q`` or Ctrl-C leaves (exit 0).  Only the wire
protocol is used: nothing of the daemon is imported.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import threading
import time
import tty
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from inferd_client.client import OperatorClient
from inferd_client.errors import ClientError
from inferd_client.events import EventSubscriber

EVENT_TOPICS = ("alert", "build", "runtime")
RECENT_ALERTS = 5
SHOWN_BUILDS = 6
#: How long the screen may wait for a key before it looks at the events again.
_EVENT_TICK_S = 0.25


@dataclass
class _Rate:
    requests: int
    at: float


@dataclass
class TopState:
    """What the screen shows, folded from polls and events (no I/O here)."""

    status: dict[str, Any] | None = None
    builds: list[dict[str, Any]] = field(default_factory=list)
    rates: dict[str, float] = field(default_factory=dict)
    alerts: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT_ALERTS))
    #: buildId -> the latest build event's phase and step.
    phases: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    last_seen: float | None = None
    _previous: dict[str, _Rate] = field(default_factory=dict)

    def on_status(self, status: dict[str, Any], builds: list[dict[str, Any]], at: float) -> None:
        for model in status["models"]:
            name, requests = model["model"], int(model["requests"])
            previous = self._previous.get(name)
            if previous is not None and at > previous.at:
                self.rates[name] = max(0, requests - previous.requests) / (at - previous.at)
            self._previous[name] = _Rate(requests, at)
        self.status, self.builds, self.error, self.last_seen = status, builds, None, at

    def on_unreachable(self, error: str) -> None:
        self.error = error
        self._previous.clear()  # a restarted daemon counts from 0 again
        self.rates.clear()

    def on_event(self, topic: str, payload: dict[str, Any]) -> None:
        if topic == "alert":
            self.alerts.appendleft(payload)
        elif topic == "build" and payload.get("buildId"):
            step = payload.get("step")
            steps = payload.get("numSteps")
            progress = f" {int(step) + 1}/{steps}" if step is not None and steps else ""
            self.phases[str(payload["buildId"])] = f"{payload.get('name')}{progress}"


# -- rendering --------------------------------------------------------------------


def _ms(latency: dict[str, Any], key: str) -> str:
    value = latency.get(key)
    return "-" if value is None else f"{value / 1000:.2f}"


def _uptime(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _thermal(thermal: dict[str, Any]) -> str:
    if not thermal["available"]:
        return "thermal unknown (no source)"
    reading = thermal.get("last_reading") or {}
    parts = ["THROTTLING" if thermal["throttle_active"] else "thermal nominal"]
    parts.append(f"({thermal['source']})")
    for key, label in (("cpu_temp_c", "cpu"), ("gpu_temp_c", "gpu")):
        if reading.get(key) is not None:
            parts.append(f"{label} {reading[key]:.1f}°C")
    if reading.get("gpu_utilization_pct") is not None:
        parts.append(f"load {reading['gpu_utilization_pct']:.0f}%")
    if reading.get("gpu_power_w") is not None:
        parts.append(f"{reading['gpu_power_w']:.1f} W")
    return " ".join(parts)


def _header(state: TopState, endpoint: str, interval: float, now: float) -> Text:
    status = state.status
    line = Text()
    if status is not None:
        daemon = status["daemon"]
        colour = {"serving": "green", "degraded": "yellow"}.get(daemon["state"], "red")
        line.append(f"inferd {daemon['version']}  pid {daemon['pid']}  ", style="bold")
        line.append(daemon["state"], style=f"bold {colour}")
        line.append(f"  up {_uptime(daemon['uptime_s'])}  {_thermal(status['thermal'])}")
    else:
        line.append("inferd", style="bold")
    line.append(f"\n{endpoint}  every {interval:g} s  q: quit", style="dim")
    if state.error is not None:
        seen = "" if state.last_seen is None else f", last answer {now - state.last_seen:.0f} s ago"
        line.append(
            f"\ndaemon unreachable: {state.error}; retrying every {interval:g} s{seen}",
            style="bold red",
        )
    return line


def _models(status: dict[str, Any], rates: dict[str, float], stale: bool) -> Table:
    title = "models (last known: the daemon does not answer)" if stale else "models"
    table = Table(title=title, title_justify="left", expand=True, box=None, collapse_padding=True)
    # Numbers never wrap and keep their heading's width; on a narrow terminal the
    # text columns (model, state, runtime, errors) wrap instead.
    for column in ("MODEL", "STATE", "RUNTIME"):
        table.add_column(column, min_width=len(column))
    for column in ("REQ/S", "REQUESTS", "OK"):
        table.add_column(column, no_wrap=True, min_width=len(column))
    table.add_column("ERRORS", min_width=len("ERRORS"))
    for column in ("P50 ms", "P99 ms", "QUEUE"):
        table.add_column(column, justify="right", no_wrap=True, min_width=len(column))
    for model in status["models"]:
        responses = model["responses"]
        runtime = model["runtime"] or "-"
        if model["fallback"]:
            runtime += " (fallback)"  # from its configured tensorrt
        errors = ", ".join(f"{code} {n}" for code, n in sorted(responses.items()) if code != "OK")
        rate = rates.get(model["model"])
        table.add_row(
            model["model"],
            model["state"],
            runtime,
            "-" if rate is None else f"{rate:.1f}",
            str(model["requests"]),
            str(responses.get("OK", 0)),
            errors or "-",
            _ms(model["latency_us"], "p50"),
            _ms(model["latency_us"], "p99"),
            f"{model['queue_depth']}/{model['queue_capacity']}",
        )
    return table


def _shm(shm: dict[str, Any]) -> Text:
    """One line for the shared-memory regions (``status.shm``)."""
    if not shm.get("enabled"):
        return Text("shared memory off", style="dim")
    mib = 1024 * 1024
    line = Text(
        f"shared memory  {shm['connections']}/{shm['max_connections']} connections  "
        f"{len(shm['regions'])} regions  "
        f"{shm['mapped_bytes'] / mib:.1f} of {shm['max_bytes_total'] / mib:.0f} MiB mapped  "
        f"{shm['in_flight']} in flight"
    )
    refused = sum(shm.get("refused", {}).values())
    if refused:
        line.append(f"  {refused} refused", style="yellow")
    by_uid = shm.get("refused_by_uid") or {}
    if by_uid:  # of those, the connections over shm.max_connections_per_uid
        uids = ", ".join(f"uid {uid}: {count}" for uid, count in sorted(by_uid.items()))
        line.append(f" ({sum(by_uid.values())} over a uid's connections: {uids})", style="yellow")
    denied = shm.get("denied_by_uid") or {}
    if denied:  # security.infer_allow at accept
        uids = ", ".join(f"uid {uid}: {count}" for uid, count in sorted(denied.items()))
        line.append(f"  {sum(denied.values())} denied ({uids})", style="yellow")
    if shm.get("releasing_regions"):
        line.append(f"  {shm['releasing_regions']} released, not yet unmapped", style="yellow")
    if shm.get("unroutable_replies"):
        line.append(f"  {shm['unroutable_replies']} replies to gone clients", style="yellow")
    if not shm.get("thread_alive", True):
        line.append("  registration thread DOWN", style="bold red")
    return line


def _guard(security: dict[str, Any]) -> Text | None:
    """One line for the descriptor guard (``status.security.descriptor_guard``):
    the floods it ended connections of, and of those how many past a fair share."""
    guard = security.get("descriptor_guard")
    if guard is None:  # an older daemon, or one not started
        return None
    if not guard.get("episodes"):
        return Text("descriptor guard  no floods", style="dim")
    return Text(
        f"descriptor guard  {guard['episodes']} floods, "
        f"{guard.get('connections_ended', 0)} connections ended, "
        f"{guard.get('connections_ended_past_share', 0)} past a fair share "
        f"in {guard.get('share_passes', 0)} passes",
        style="yellow",
    )


def _builds(
    builds: list[dict[str, Any]], phases: dict[str, str], start_refused: dict[str, int]
) -> Table:
    """The running and latest builds; the title counts ``build.start``'s refusals."""
    title = Text("builds")
    if start_refused:
        codes = ", ".join(f"{code} {n}" for code, n in sorted(start_refused.items()))
        title.append(
            f"  build.start refused {sum(start_refused.values())} ({codes})", style="yellow"
        )
    table = Table(title=title, title_justify="left", expand=True, box=None)
    for column in ("BUILD", "MODEL", "BUILDER", "STATE", "ELAPSED s", "PHASE"):
        table.add_column(column, no_wrap=True)
    running = [b for b in builds if b["state"] == "running"]
    shown = (running + [b for b in reversed(builds) if b["state"] != "running"])[:SHOWN_BUILDS]
    for build in shown:
        table.add_row(
            build["build_id"],
            build["model"],
            build["builder"],
            build["state"],
            f"{build['elapsed_s']:.1f}",
            phases.get(build["build_id"], "-") if build["state"] == "running" else "-",
        )
    if not shown:
        table.add_row("-", "no builds", "", "", "", "")
    return table


def _alerts(alerts: deque[dict[str, Any]]) -> Table:
    table = Table(title="recent alerts", title_justify="left", expand=True, box=None)
    for column in ("TIME", "LEVEL", "CODE", "MESSAGE"):
        table.add_column(column, no_wrap=column != "MESSAGE", overflow="ellipsis")
    for alert in alerts:
        when = datetime.fromtimestamp(int(alert.get("ts_ns", 0)) / 1e9).strftime("%H:%M:%S")
        table.add_row(when, str(alert.get("level")), str(alert.get("code")), alert.get("message"))
    if not alerts:
        table.add_row("-", "", "none since start", "")
    return table


def render(state: TopState, endpoint: str, interval: float, now: float) -> RenderableType:
    parts: list[RenderableType] = [_header(state, endpoint, interval, now), Text()]
    start_refused: dict[str, int] = {}
    if state.status is not None:
        parts += [_models(state.status, state.rates, state.error is not None), Text()]
        parts.append(_shm(state.status.get("shm") or {}))
        guard = _guard(state.status.get("security") or {})
        parts += [Text()] if guard is None else [guard, Text()]
        start_refused = (state.status.get("builds") or {}).get("start_refused") or {}
    parts += [_builds(state.builds, state.phases, start_refused), Text(), _alerts(state.alerts)]
    return Group(*parts)


# -- the loop -----------------------------------------------------------------------


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str | None]]:
    """``wait(timeout)`` -> a key pressed within ``timeout``, or None.  The terminal
    is in cbreak mode meanwhile (keys without Enter; Ctrl-C still interrupts)."""
    stdin = sys.stdin
    if not stdin.isatty():  # no keys to read (a pipe): wait, and let Ctrl-C end it
        pause = threading.Event()

        def no_key(timeout: float) -> str | None:
            pause.wait(timeout)
            return None

        yield no_key
        return
    fd = stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def wait(timeout: float) -> str | None:
        readable, _, _ = select.select([fd], [], [], max(0.0, timeout))
        return os.read(fd, 1).decode(errors="replace") if readable else None

    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class _Connection:
    """The control client (made again after a failure: a restarted daemon must not
    get the requests that waited for the old one) and the event subscriber."""

    def __init__(self, control: Callable[[], OperatorClient], events: EventSubscriber) -> None:
        self._make = control
        self._control: OperatorClient | None = None
        self.events = events

    def poll(self, state: TopState, timeout: float) -> None:
        try:
            if self._control is None:
                self._control = self._make()
            status = self._control.call("status", timeout=timeout)
            builds = self._control.call("build.status", timeout=timeout).get("builds", [])
        except ClientError as exc:
            state.on_unreachable(str(exc))
            if self._control is not None:
                self._control.close()
                self._control = None
            return
        state.on_status(status, builds, time.monotonic())

    def drain(self, state: TopState) -> None:
        with contextlib.suppress(ClientError):
            while (event := self.events.receive(timeout=0)) is not None:
                state.on_event(*event)

    def close(self) -> None:
        if self._control is not None:
            self._control.close()
        self.events.close()


def run(
    control: Callable[[], OperatorClient],
    events: EventSubscriber,
    *,
    endpoint: str,
    interval: float,
) -> int:
    """Show the view until ``q`` or Ctrl-C; returns the exit status (0)."""
    if interval <= 0:
        raise ValueError(f"--interval must be positive, got {interval:g}")
    state = TopState()
    connection = _Connection(control, events)
    console = Console()
    timeout = min(max(interval, 0.5), 3.0)
    try:
        with _keys() as wait_key, Live(console=console, screen=True, auto_refresh=False) as live:
            next_poll = time.monotonic()
            while True:
                if time.monotonic() >= next_poll:
                    connection.poll(state, timeout)
                    next_poll = time.monotonic() + interval
                connection.drain(state)
                live.update(render(state, endpoint, interval, time.monotonic()), refresh=True)
                key = wait_key(min(_EVENT_TICK_S, max(0.0, next_poll - time.monotonic())))
                if key in ("q", "Q"):
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        connection.close()
