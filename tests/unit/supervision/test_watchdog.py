"""Watchdog gating: WATCHDOG_USEC/WATCHDOG_PID, pings at half the interval, and
no ping while any probed thread is silent or gone."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from inferd.supervision.notify import Notifier
from inferd.supervision.watchdog import MIN_SILENCE_S, Watchdog, WatchdogSettings
from inferd.types import Liveness

S = 1_000_000_000  # ns


class FakeNotifier(Notifier):
    def __init__(self) -> None:
        super().__init__("@unused")
        self.assignments: list[str] = []

    def send(self, *assignments: str) -> bool:
        self.assignments.extend(assignments)
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000 * S

    def __call__(self) -> int:
        return self.now


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "4000000"}, 4.0),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "4242"}, 4.0),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}, None),  # a parent's watchdog
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "x"}, None),
    ],
)
def test_settings_from_environment(environ: dict[str, str], expected: float | None) -> None:
    settings = WatchdogSettings.from_environment(environ, pid=4242)
    assert (settings.interval_s if settings else None) == expected


def test_ping_at_half_the_interval_and_silence_limit() -> None:
    settings = WatchdogSettings(interval_s=10.0)
    assert settings.ping_every_s == 5.0
    assert settings.silence_limit_s == 5.0
    # Short intervals never count a thread's idle beat period as silence.
    assert WatchdogSettings(interval_s=1.0).silence_limit_s == MIN_SILENCE_S


def _watchdog(beats: dict[str, int | None], clock: Clock) -> tuple[Watchdog, FakeNotifier]:
    notifier = FakeNotifier()
    watchdog = Watchdog(
        notifier,
        WatchdogSettings(interval_s=4.0),
        lambda: {name: Liveness(beat) for name, beat in beats.items()},
        clock=clock,
    )
    return watchdog, notifier


def test_pings_while_every_thread_beats() -> None:
    clock = Clock()
    beats: dict[str, int | None] = dict.fromkeys(("engine_worker", "bus", "publisher"), clock.now)
    watchdog, notifier = _watchdog(beats, clock)
    assert watchdog.tick()
    assert not watchdog.tick()  # not due yet
    assert watchdog.due_in_s() == 2.0
    clock.now += 2 * S
    beats.update(engine_worker=clock.now, bus=clock.now, publisher=clock.now)
    assert watchdog.tick()
    assert notifier.assignments == ["WATCHDOG=1", "WATCHDOG=1"]
    assert watchdog.describe() is None


def test_a_stuck_worker_withholds_pings_until_it_beats_again() -> None:
    clock = Clock()
    beats: dict[str, int | None] = {"engine_worker": clock.now, "bus": clock.now}
    watchdog, notifier = _watchdog(beats, clock)
    assert watchdog.tick()
    # The worker enters a long runtime call; the bus keeps beating.
    with capture_logs() as logs:
        for _ in range(10):
            clock.now += S
            beats["bus"] = clock.now
            watchdog.tick()
    # Pinged at 0 s and 2 s (silence 2 s is within the limit), none after.
    assert notifier.assignments == ["WATCHDOG=1", "WATCHDOG=1"]
    assert watchdog.withheld > 0
    assert list(watchdog.silent) == ["engine_worker"]
    assert "engine_worker silent 10 s" in (watchdog.describe() or "")
    withheld = [entry for entry in logs if entry["event"] == "watchdog_pings_withheld"]
    assert len(withheld) == 1 and withheld[0]["log_level"] == "error"
    # The call returns: the next tick (within 0.5 s) pings again.
    clock.now += S // 2
    beats.update(engine_worker=clock.now, bus=clock.now)
    with capture_logs() as logs:
        assert watchdog.tick()
    assert [entry["event"] for entry in logs] == ["watchdog_pings_resumed"]
    assert watchdog.describe() is None


def test_a_dead_thread_withholds_pings() -> None:
    clock = Clock()
    beats: dict[str, int | None] = {"engine_worker": clock.now, "publisher": None}
    watchdog, notifier = _watchdog(beats, clock)
    assert not watchdog.tick()
    assert notifier.assignments == []
    assert watchdog.describe() == "watchdog withheld: publisher silent (not running)"


def test_silence_within_the_limit_does_not_withhold() -> None:
    clock = Clock()
    beats: dict[str, int | None] = {"bus": clock.now}
    watchdog, _ = _watchdog(beats, clock)
    clock.now += int(1.9 * S)  # limit for a 4 s watchdog is 2 s
    assert watchdog.tick()
    assert watchdog.silent_threads() == {}
    clock.now += int(0.2 * S)
    assert watchdog.silent_threads() == {"bus": 2.1}
