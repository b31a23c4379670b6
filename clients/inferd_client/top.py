"""``inferctl top``: a live terminal view of a running daemon.

Every ``--interval`` seconds it asks the control socket for ``status`` and
``build.status``; between polls it reads the events socket (``alert``,
``build``, ``runtime``), so alerts and build progress show as they happen.
Request rates are the difference of two ``status`` snapshots over the time
between them.  A daemon that does not answer is shown as unreachable and asked
again at the next interval; ``q`` or Ctrl-C leaves (exit 0).  A control or
events connection the daemon refuses at its handshake ends the view: ``inferctl``
says so and exits 3, as for any ``ConnectionRefused``.  Only the wire
protocol is used: nothing of the daemon is imported.

What the daemon sends is shown as plain text (``rich.text.Text``, never markup)
through ``cli_format.printable``: a model's name or an alert's message shows no
``[style]`` and drives no terminal.  A section that a reply of another version
cannot fill (a field missing, or of another type) says so; the others are shown.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import sys
import termios
import threading
import time
import tty
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from inferd_client.cli_format import printable, text
from inferd_client.client import OperatorClient
from inferd_client.errors import ClientError, ConnectionRefused
from inferd_client.events import EventSubscriber

EVENT_TOPICS = ("alert", "build", "runtime")
RECENT_ALERTS = 5
SHOWN_BUILDS = 6
#: How long the screen may wait for a key before it looks at the events again.
_EVENT_TICK_S = 0.25
#: A section of the screen (the descriptor guard's is None when it is not started).
_Shown = TypeVar("_Shown", bound="RenderableType | None")


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
        for model in _maps(status.get("models")):
            try:  # a model without a count (another version's status) has no rate
                name, requests = str(model["model"]), int(model["requests"])
            except (KeyError, TypeError, ValueError):
                continue
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
            progress = f" {step + 1}/{steps}" if isinstance(step, int) and steps else ""
            self.phases[str(payload["buildId"])] = f"{payload.get('name')}{progress}"


def _maps(rows: Any) -> list[Mapping[str, Any]]:
    """The maps of a list (a row of another shape is not shown), none for a non-list."""
    return [row for row in rows if isinstance(row, Mapping)] if isinstance(rows, list) else []


# -- rendering --------------------------------------------------------------------


def _cell(value: Any) -> Text:
    """A value as plain text: ``cli_format.text``, escaped, and never read as markup."""
    return Text(text(value))


def _section(title: str, draw: Callable[[], _Shown]) -> _Shown | Text:
    """``draw()``, or a line saying why ``title`` is not shown: a status of a daemon
    of another version must not end the view."""
    try:
        return draw()
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        why = printable(f"{type(exc).__name__}: {exc}")
        return Text(f"{title}: not shown, the daemon's reply differs ({why})", style="yellow")


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
        line.append(f"inferd {text(daemon['version'])}  pid {text(daemon['pid'])}  ", style="bold")
        line.append(text(daemon["state"]), style=f"bold {colour}")
        line.append(f"  up {_uptime(daemon['uptime_s'])}  {printable(_thermal(status['thermal']))}")
    else:
        line.append("inferd", style="bold")
    line.append(f"\n{printable(endpoint)}  every {interval:g} s  q: quit", style="dim")
    if state.error is not None:
        seen = "" if state.last_seen is None else f", last answer {now - state.last_seen:.0f} s ago"
        line.append(
            f"\ndaemon unreachable: {printable(state.error)}; retrying every {interval:g} s{seen}",
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
    for model in _maps(status["models"]):
        responses = model.get("responses") or {}
        runtime = text(model.get("runtime"))
        if model.get("fallback"):
            runtime += " (fallback)"  # from its configured tensorrt
        errors = ", ".join(
            f"{text(code)} {text(n)}" for code, n in sorted(responses.items()) if code != "OK"
        )
        rate = rates.get(str(model.get("model")))
        latency = model.get("latency_us") or {}
        table.add_row(
            _cell(model.get("model")),
            _cell(model.get("state")),
            Text(runtime),
            "-" if rate is None else f"{rate:.1f}",
            _cell(model.get("requests")),
            _cell(responses.get("OK", 0)),
            Text(errors or "-"),
            _ms(latency, "p50"),
            _ms(latency, "p99"),
            Text(f"{text(model.get('queue_depth'))}/{text(model.get('queue_capacity'))}"),
        )
    return table


def _shm(shm: dict[str, Any]) -> Text:
    """One line for the shared-memory regions (``status.shm``)."""
    if not shm.get("enabled"):
        if shm.get("reason"):  # [shm] asked for, refused by the host (strict overcommit)
            return Text(printable(f"shared memory off: {shm['reason']}"), style="yellow")
        return Text("shared memory off", style="dim")
    mib = 1024 * 1024
    line = Text(
        printable(
            f"shared memory  {shm['connections']}/{shm['max_connections']} connections  "
            f"{shm.get('regions_mapped', len(shm['regions']))} regions  "
            f"{shm['mapped_bytes'] / mib:.1f} of {shm['max_bytes_total'] / mib:.0f} MiB mapped  "
            f"{shm['in_flight']} in flight"
        )
    )
    refused = sum(shm.get("refused", {}).values())
    if refused:
        line.append(f"  {refused} refused", style="yellow")
    by_uid = shm.get("refused_by_uid") or {}
    if by_uid:  # of those, the connections over shm.max_connections_per_uid
        uids = ", ".join(f"uid {uid}: {count}" for uid, count in sorted(by_uid.items()))
        line.append(
            printable(f" ({sum(by_uid.values())} over a uid's connections: {uids})"),
            style="yellow",
        )
    denied = shm.get("denied_by_uid") or {}
    if denied:  # security.infer_allow at accept
        uids = ", ".join(f"uid {uid}: {count}" for uid, count in sorted(denied.items()))
        line.append(printable(f"  {sum(denied.values())} denied ({uids})"), style="yellow")
    if shm.get("releasing_regions"):
        line.append(
            f"  {text(shm['releasing_regions'])} released, not yet unmapped", style="yellow"
        )
    if shm.get("unroutable_replies"):
        line.append(f"  {text(shm['unroutable_replies'])} replies to gone clients", style="yellow")
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
        printable(
            f"descriptor guard  {guard['episodes']} floods, "
            f"{guard.get('connections_ended', 0)} connections ended, "
            f"{guard.get('connections_ended_past_share', 0)} past a fair share "
            f"in {guard.get('share_passes', 0)} passes"
        ),
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
            printable(f"  build.start refused {sum(start_refused.values())} ({codes})"),
            style="yellow",
        )
    table = Table(title=title, title_justify="left", expand=True, box=None)
    for column in ("BUILD", "MODEL", "BUILDER", "STATE", "ELAPSED s", "PHASE"):
        table.add_column(column, no_wrap=True)
    rows = _maps(builds)
    running = [b for b in rows if b.get("state") == "running"]
    shown = (running + [b for b in reversed(rows) if b.get("state") != "running"])[:SHOWN_BUILDS]
    for build in shown:
        phase = phases.get(str(build.get("build_id"))) if build.get("state") == "running" else None
        table.add_row(
            _cell(build.get("build_id")),
            _cell(build.get("model")),
            _cell(build.get("builder")),
            _cell(build.get("state")),
            _cell(build.get("elapsed_s")),
            _cell(phase),
        )
    if not shown:
        table.add_row("-", "no builds", "", "", "", "")
    return table


def _alerts(alerts: deque[dict[str, Any]]) -> Table:
    table = Table(title="recent alerts", title_justify="left", expand=True, box=None)
    for column in ("TIME", "LEVEL", "CODE", "MESSAGE"):
        table.add_column(column, no_wrap=column != "MESSAGE", overflow="ellipsis")
    for alert in alerts:
        ts_ns = alert.get("ts_ns")
        when = (
            datetime.fromtimestamp(ts_ns / 1e9).strftime("%H:%M:%S")
            if isinstance(ts_ns, int)
            else "-"
        )
        table.add_row(
            when, _cell(alert.get("level")), _cell(alert.get("code")), _cell(alert.get("message"))
        )
    if not alerts:
        table.add_row("-", "", "none since start", "")
    return table


def render(state: TopState, endpoint: str, interval: float, now: float) -> RenderableType:
    parts: list[RenderableType] = [
        _section("daemon", lambda: _header(state, endpoint, interval, now)),
        Text(),
    ]
    start_refused: dict[str, int] = {}
    status = state.status
    if status is not None:
        stale = state.error is not None
        parts += [_section("models", lambda: _models(status, state.rates, stale)), Text()]
        parts.append(_section("shared memory", lambda: _shm(status.get("shm") or {})))
        guard = _section("descriptor guard", lambda: _guard(status.get("security") or {}))
        parts += [Text()] if guard is None else [guard, Text()]
        with contextlib.suppress(AttributeError):  # a status without the map: none shown
            start_refused = (status.get("builds") or {}).get("start_refused") or {}
    builds = _section("builds", lambda: _builds(state.builds, state.phases, start_refused))
    parts += [builds, Text(), _section("recent alerts", lambda: _alerts(state.alerts))]
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
        except ConnectionRefused:
            # Refused at the handshake: asking again every interval would be refused
            # again, and the view would read "unreachable" as if the daemon were down.
            self.close_control()
            raise
        except ClientError as exc:
            state.on_unreachable(str(exc))
            self.close_control()
            return
        state.on_status(status, builds, time.monotonic())

    def close_control(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None

    def drain(self, state: TopState) -> None:
        """The events that came since; a subscriber the daemon refused ends the view
        (``inferctl`` says why and exits as for any refused connection): its alerts
        and builds would stay empty without a word."""
        try:
            while (event := self.events.receive(timeout=0)) is not None:
                state.on_event(*event)
        except ConnectionRefused:
            raise
        except ClientError:
            pass

    def close(self) -> None:
        self.close_control()
        self.events.close()


def run(
    control: Callable[[], OperatorClient],
    events: EventSubscriber,
    *,
    endpoint: str,
    interval: float,
) -> int:
    """Show the view until ``q`` or Ctrl-C; returns the exit status (0)."""
    if not 0 < interval < math.inf:  # NaN too: it would never poll again, and spin
        raise ValueError(
            f"--interval must be a finite number of seconds more than 0, got {interval:g}"
        )
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
