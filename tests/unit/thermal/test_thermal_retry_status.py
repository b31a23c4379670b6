"""What the background retries of a failed thermal source open log, and what
``status.thermal`` says of them (``fallthrough.SourceOpens.retries``,
``_noted``, ``why_none``; ``retrying.RetryBackoff``).

An open that crashed (an exception other than the source's expected
``TelemetryUnavailableError``) logged ``thermal_source_open_crashed`` with its
traceback at every retry: 15 in the first ten minutes, then one a minute for
the whole flight.  It is now logged once per streak of the same failure, as an
expected failure logs nothing per retry, and both are counted in
``status.thermal.retries``, with the latest reason and when the source is
opened again.  The polls run one by one on a fake clock; between two, the test
waits for the retry's thread to have ended.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal import OPENERS, ThermalMonitor
from inferd.thermal.bounded_read import OPEN_THREAD_NAME
from tests.conftest import HANG_S, wait_until
from tests.integration.test_schemas import assert_valid
from tests.unit.thermal.conftest import FakeClock, ScriptedSource, Sinks, reading

#: When jtop's open, failing every time from 0 s, is opened at 1 Hz over 600 s
#: (entry 286: waits of 1, 2, 4, ... s, then the 60 s re-probe interval).
RETRIED_AT = [0, 1, 3, 7, 15, 31, 63, 123, 183, 243, 303, 363, 423, 483, 543]
CRASHED = "thermal_source_open_crashed"
THERMAL_STATUS = "common.json#/$defs/thermal_status"


@pytest.fixture
def earlier() -> Iterator[set[threading.Thread]]:
    """Open threads that earlier tests left running (a hung open ends on its
    own): not this test's.  This test's have ended when it does."""
    before = {t for t in threading.enumerate() if t.name == OPEN_THREAD_NAME}
    yield before
    wait_until(lambda: not open_threads(before), message="the open threads ending")


def open_threads(earlier: set[threading.Thread]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.name == OPEN_THREAD_NAME and t.is_alive() and t not in earlier
    ]


class Scripted:
    """An ``OPENERS`` entry whose n-th open does ``steps[n]`` (the last one
    again past the end): raise it, or return it as the opened source; ``hold``
    makes the open of that number (1-based) wait for ``release``.  Notes when
    (s on the fake clock since it was made) each open started."""

    def __init__(
        self, clock: FakeClock, steps: list[BaseException | ScriptedSource], hold: int = 0
    ) -> None:
        self._clock = clock
        self._started_ns = clock.now_ns
        self.steps = steps
        self.hold = hold
        self.at: list[float] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.ended = threading.Event()

    def __call__(self, _config: ThermalConfig) -> ScriptedSource:
        self.at.append((self._clock.now_ns - self._started_ns) / 1e9)
        try:
            if len(self.at) == self.hold:
                self.entered.set()
                self.release.wait(HANG_S)
            step = self.steps[min(len(self.at), len(self.steps)) - 1]
            if isinstance(step, BaseException):
                raise step
            return step
        finally:
            self.ended.set()


def polling(
    monkeypatch: pytest.MonkeyPatch, jtop: Scripted, sysfs: Scripted, clock: FakeClock
) -> tuple[ThermalMonitor, Sinks]:
    monkeypatch.setitem(OPENERS, "jtop", jtop)
    monkeypatch.setitem(OPENERS, "sysfs", sysfs)
    sinks = Sinks()
    config = ThermalConfig(sources=("jtop", "sysfs"), throttle_enter_c=80.0, poll_hz=1.0)
    # A deadline no open here comes near in real time: a held retry is not a hang.
    monitor = ThermalMonitor(
        config, events=sinks.event, record=sinks.record, clock=clock, stale_after_s=HANG_S
    )
    return monitor, sinks


def poll(monitor: ThermalMonitor, earlier: set[threading.Thread]) -> dict[str, Any]:
    """One poll once a retry in progress has ended (its outcome is this poll's),
    and once the retry it started (failing in microseconds) has ended."""
    settled(earlier)
    monitor._poll_once()
    settled(earlier)
    return monitor.describe()


def settled(earlier: set[threading.Thread]) -> None:
    wait_until(lambda: not open_threads(earlier), message="the retry's thread ending")


def crashes(logs: list[MutableMapping[str, Any]]) -> list[tuple[str, int]]:
    return [(e["error"], e["failed_opens"]) for e in logs if e["event"] == CRASHED]


@pytest.mark.parametrize("crash", [True, False], ids=["crashing", "unavailable"])
def test_a_failing_open_is_logged_once_over_ten_minutes_of_retries(
    monkeypatch: pytest.MonkeyPatch, earlier: set[threading.Thread], crash: bool
) -> None:
    """jtop's open fails at every try, a bug's crash or the expected "not
    active", while sysfs is read: opened 15 times in ten minutes, the crash's
    traceback is logged once, the expected failure not at all (the selection's
    ``thermal_source_selected`` names it), and nothing else differs; status
    counts the 15 failures and says when the next retry is due."""
    clock = FakeClock()
    failure = RuntimeError("bad socket state") if crash else TelemetryUnavailableError("inactive")
    jtop = Scripted(clock, [failure])
    sysfs = Scripted(clock, [ScriptedSource(reading(cpu=47.0), name="sysfs")])
    monitor, sinks = polling(monkeypatch, jtop, sysfs, clock)
    with capture_logs() as logs:
        for _ in range(600):
            described = poll(monitor, earlier)
            clock.advance(1)
    assert jtop.at == RETRIED_AT and sysfs.at == [0]
    reason = "RuntimeError: bad socket state" if crash else "inactive"
    tracebacks = [e for e in logs if e.get("exc_info") is not None]
    assert len(tracebacks) == (1 if crash else 0)  # was one per open: 15
    assert crashes(logs) == ([(reason, 1)] if crash else [])
    if crash:
        (logged,) = [e for e in logs if e["event"] == CRASHED]
        assert isinstance(logged["exc_info"], RuntimeError) and logged["source"] == "jtop"
    others = [e["event"] for e in logs if e["event"] != CRASHED]
    assert others == ["thermal_source_selected"]  # the same for either failure
    # The last try at 543 s, the next due 60 s later; the last poll was at 599 s.
    assert described["retries"] == {
        "jtop": {
            "failed_opens": 15,
            "last_error": reason,
            "running_s": None,
            "next_try_in_s": 4.0,
        }
    }
    assert described["skipped_sources"] == {"jtop": reason} and described["last_error"] is None
    assert [p["available"] for _, p in sinks.events] == [True] * 600
    assert monitor.stop()


def test_a_crash_is_logged_again_when_its_error_changes_or_after_the_source_opened(
    monkeypatch: pytest.MonkeyPatch, earlier: set[threading.Thread]
) -> None:
    """Opens of jtop: crash A, A, crash B, unavailable, A, opens (and takes
    over, then its reads fail), and from the re-probe on A at every retry.  A
    traceback is logged for the first A, B, the A after the unavailable one,
    and the first A after jtop had opened: 4 of the 11 crashes in 200 s."""
    clock = FakeClock()
    jtop_source = ScriptedSource(reading(cpu=61.0), name="jtop")
    a, b = RuntimeError("A"), ValueError("B")
    unavailable = TelemetryUnavailableError("jtop: service: not active")
    jtop = Scripted(clock, [a, a, b, unavailable, a, jtop_source, a])
    sysfs = Scripted(clock, [ScriptedSource(reading(cpu=47.0), name="sysfs")])
    monitor, _ = polling(monkeypatch, jtop, sysfs, clock)
    sources: list[tuple[int, str | None]] = []
    with capture_logs() as logs:
        for second in range(200):
            source = poll(monitor, earlier)["source"]
            if not sources or sources[-1][1] != source:
                sources.append((second, source))
            if source == "jtop":  # it opened: now its reads fail, until a re-probe
                jtop_source.step = TelemetryUnavailableError("jtop: socket closed")
            clock.advance(1)
    # Opened at 31 s (taken at 32), failing from 33 s: re-probed at 93 s.
    assert sources == [(0, "sysfs"), (32, "jtop"), (93, "sysfs")]
    assert jtop.at == [0, 1, 3, 7, 15, 31, 93, 94, 96, 100, 108, 124, 156]
    assert [e["event"] for e in logs].count(CRASHED) == 4  # was one per crash: 11
    assert crashes(logs) == [
        ("RuntimeError: A", 1),
        ("ValueError: B", 3),
        ("RuntimeError: A", 5),
        ("RuntimeError: A", 1),  # the first since jtop opened
    ]
    assert monitor.describe()["retries"]["jtop"]["failed_opens"] == 7
    assert monitor.stop()


def test_status_says_how_many_opens_failed_the_latest_error_and_when_the_next_is_due(
    monkeypatch: pytest.MonkeyPatch, earlier: set[threading.Thread]
) -> None:
    """jtop's first open fails; its retry at 1 s runs for a while and fails with
    another reason; the retry at 3 s opens it.  Meanwhile sysfs is read, and
    ``retries`` says at each poll what was tried, what runs and what is due."""
    clock = FakeClock()
    jtop_source = ScriptedSource(reading(cpu=61.0), name="jtop")
    jtop = Scripted(
        clock,
        [
            TelemetryUnavailableError("jtop: service: not active"),
            TelemetryUnavailableError("jtop: service: activating"),
            jtop_source,
        ],
        hold=2,
    )
    sysfs = Scripted(clock, [ScriptedSource(reading(cpu=47.0), name="sysfs")])
    monitor, sinks = polling(monkeypatch, jtop, sysfs, clock)

    def retries() -> dict[str, Any]:
        described = monitor.describe()
        assert_valid(THERMAL_STATUS, described)
        assert described["last_error"] is None and described["available"]  # no poll lost
        retries: dict[str, Any] = described["retries"]
        return retries

    def jtop_retry(failed: int, error: str, running_s: float | None, next_s: float | None) -> Any:
        return {
            "jtop": {
                "failed_opens": failed,
                "last_error": error,
                "running_s": running_s,
                "next_try_in_s": next_s,
            }
        }

    try:
        with capture_logs() as logs:
            poll(monitor, earlier)
            assert retries() == jtop_retry(1, "service: not active", None, 1.0)
            clock.advance(0.5)
            poll(monitor, earlier)
            assert retries() == jtop_retry(1, "service: not active", None, 0.5)
            clock.advance(0.5)
            monitor._poll_once()  # 1 s: the retry starts, and is held
            assert jtop.entered.wait(HANG_S)
            assert retries() == jtop_retry(1, "service: not active", 0.0, None)
            clock.advance(1)
            monitor._poll_once()  # 2 s: it still runs
            assert retries() == jtop_retry(1, "service: not active", 1.0, None)
            jtop.release.set()
            assert jtop.ended.wait(HANG_S)
            clock.advance(0.5)
            poll(monitor, earlier)  # 2.5 s: its failure is taken; the next due at 3 s
            assert retries() == jtop_retry(2, "service: activating", None, 0.5)
            clock.advance(0.5)
            poll(monitor, earlier)  # 3 s: the retry that opens it
            clock.advance(1)
            poll(monitor, earlier)  # 4 s: jtop read
            assert monitor.describe()["source"] == "jtop" and retries() == {}
    finally:
        jtop.release.set()
    assert jtop.at == [0.0, 1.0, 3.0]
    assert [e for e in logs if e["event"] in (CRASHED, "thermal_telemetry_unavailable")] == []
    assert sinks.records == [] and monitor.stop() and jtop_source.closed == 1


def test_with_no_source_in_use_a_retry_in_progress_is_named_as_one(
    monkeypatch: pytest.MonkeyPatch, earlier: set[threading.Thread]
) -> None:
    """sysfs is read while jtop's first retry runs; sysfs then fails for a
    re-probe interval and cannot be opened again.  ``last_error`` says there is
    no source, with jtop's reason as the try before a retry that has run so
    long (it was the bare reasons, as if an open hung); ``retries`` says when
    the next selection opens both, and it opens them then."""
    clock = FakeClock()
    jtop = Scripted(
        clock,
        [
            TelemetryUnavailableError("jtop: service: not active"),
            TelemetryUnavailableError("jtop: service: failed"),
        ],
        hold=2,
    )
    sysfs_source = ScriptedSource(reading(cpu=47.0), name="sysfs")
    sysfs = Scripted(clock, [sysfs_source, TelemetryUnavailableError("sysfs: no zones")])
    monitor, _ = polling(monkeypatch, jtop, sysfs, clock)
    try:
        monitor._poll_once()  # 0 s: jtop failed, sysfs read
        clock.advance(1)
        monitor._poll_once()  # 1 s: jtop's retry starts, and is held
        assert jtop.entered.wait(HANG_S)
        sysfs_source.step = TelemetryUnavailableError("sysfs: zone vanished")
        for _ in range(61):  # 2 .. 62 s: failing from 2 s, re-probed at 62 s
            clock.advance(1)
            monitor._poll_once()
        described = monitor.describe()
        assert_valid(THERMAL_STATUS, described)
        assert described["source"] is None and sysfs.at == [0.0, 62.0]
        assert described["last_error"] == (
            "no thermal source available "
            "(jtop: service: not active (a retry has run for 61.0 s); sysfs: no zones)"
        )
        assert described["retries"] == {
            "jtop": {
                "failed_opens": 1,
                "last_error": "service: not active",
                "running_s": 61.0,
                "next_try_in_s": None,
            },
            "sysfs": {
                "failed_opens": 1,
                "last_error": "no zones",
                "running_s": None,
                "next_try_in_s": 60.0,
            },
        }
    finally:
        jtop.release.set()
    assert jtop.ended.wait(HANG_S)
    clock.advance(1)
    described = poll(monitor, earlier)  # 63 s: the retry's failure is taken
    assert described["last_error"] == (
        "no thermal source available (jtop: service: failed; sysfs: no zones)"
    )
    assert {name: r["next_try_in_s"] for name, r in described["retries"].items()} == {
        "jtop": 59.0,
        "sysfs": 59.0,
    }
    assert described["retries"]["jtop"]["failed_opens"] == 2
    for _ in range(70):  # the next selection opens both, when status said
        clock.advance(1)
        poll(monitor, earlier)
        if len(sysfs.at) > 2:
            break
    assert sysfs.at == [0.0, 62.0, 122.0] and jtop.at == [0.0, 1.0, 122.0]
    assert monitor.stop()
