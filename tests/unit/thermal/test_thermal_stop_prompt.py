"""The thermal monitor's stop waits for no read and no open (``ThermalMonitor.stop``).

Entry 257 of DESIGN.md made the stop leave an open *past* its deadline.  Two
waits were left.  A stop while the poll still waited for an open within its
deadline (the first seconds after ``start()``, or a re-probe's open) waited
out the rest of it (default 5 s): the stop joins the poll thread.  And a read
that hung (within its deadline or past it) cost the stop its whole timeout,
since the stop cannot close a source a thread is reading; the source was then
left open for good (NVML never shut down).  Now ``stop()`` wakes the poll's
wait at once; an open is abandoned as one past its deadline is (it closes
what it opens when it returns), and a read is handed the source it reads,
which its own thread closes when the read returns.  The stop says what it
left: ``abandoned_opens``, ``abandoned_read`` and ``thermal_monitor_stop_timeout``
(``abandoned``, ``left_to_read``).  The fakes block on an Event the test sets.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, MutableMapping
from types import ModuleType
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ThermalConfig
from inferd.stop_budget import THERMAL_S
from inferd.thermal import OPENERS, THREAD_NAME, ThermalMonitor
from inferd.thermal.bounded_read import OPEN_THREAD_NAME, READ_THREAD_NAME
from inferd.thermal.reading import ThermalReading
from tests.conftest import HANG_S, wait_until
from tests.fakes import fake_jtop, fake_pynvml
from tests.unit.thermal.conftest import HangingSource, ScriptedSource, Sinks, make_monitor, reading
from tests.unit.thermal.test_monitor_open_deadline import hanging_jtop, hanging_nvml
from tests.unit.thermal.test_thermal_fallthrough import Jetson, monitor_for

STOP_EVENT = "thermal_monitor_stop_timeout"
#: The stop used to take all of it; loose, for a loaded runner.
PROMPT_S = THERMAL_S / 2


def threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def stop_timed(monitor: ThermalMonitor) -> tuple[bool, float, list[MutableMapping[str, Any]]]:
    """``stop(THERMAL_S)`` (the daemon's bound): what it returned, how long it
    took, and what it logged."""
    with capture_logs() as logs:
        started = time.monotonic()
        stopped = monitor.stop(THERMAL_S)
        took = time.monotonic() - started
    return stopped, took, logs


class HangingReads:
    """Once ``armed``, every ``nvmlDeviceGetTemperature`` blocks until ``release``
    (like a GPU whose driver stopped answering); ``entered`` says one does, on
    ``thread``."""

    def __init__(self, release: threading.Event) -> None:
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = release
        self.thread: threading.Thread | None = None


def nvml_whose_reads_hang(state: fake_pynvml.FakeNvml, hang: HangingReads) -> ModuleType:
    """The fake pynvml whose ``nvmlDeviceGetTemperature`` blocks as ``hang`` says."""
    module = fake_pynvml.make_module(state)
    get_temperature = module.nvmlDeviceGetTemperature

    def nvmlDeviceGetTemperature(handle: Any, sensor: int) -> int:
        if hang.armed.is_set():
            hang.thread = threading.current_thread()
            hang.entered.set()
            hang.release.wait(HANG_S)
        return int(get_temperature(handle, sensor))

    module.nvmlDeviceGetTemperature = nvmlDeviceGetTemperature  # type: ignore[attr-defined]
    return module


@pytest.fixture
def released() -> Iterator[threading.Event]:
    """Set at the end whatever the test did: nothing it blocked stays blocked."""
    release = threading.Event()
    yield release
    release.set()
    for name in (OPEN_THREAD_NAME, READ_THREAD_NAME):
        for thread in threads(name):
            thread.join(HANG_S)


def test_a_stop_during_jtops_first_open_does_not_wait_out_its_deadline(
    monkeypatch: pytest.MonkeyPatch, released: threading.Event
) -> None:
    """jtop's ``start()`` hangs and the first poll waits for it, within its
    default deadline (5 s): the stop used to wait out the rest of it (4.9 s
    measured).  Now it returns at once; the open, abandoned, closes the client
    it started when ``start()`` returns."""
    state = fake_jtop.FakeJtop()
    state.temperature = {"cpu": fake_jtop.sensor(61.0), "gpu": fake_jtop.sensor(58.0)}
    monkeypatch.setitem(sys.modules, "jtop", hanging_jtop(state, released))
    sinks = Sinks()
    config = ThermalConfig(sources=("jtop",), throttle_enter_c=80.0, poll_hz=1.0)
    monitor = ThermalMonitor(config, events=sinks.event, record=sinks.record)
    monitor.start()
    wait_until(lambda: len(state.clients) == 1, message="jtop's start() entered")
    (opening,) = threads(OPEN_THREAD_NAME)
    stopped, took, logs = stop_timed(monitor)
    assert took < PROMPT_S, took
    assert stopped is False  # a thread is left: said, not hidden
    assert monitor.abandoned_opens == ("jtop",) and monitor.abandoned_read is None
    assert threads(THREAD_NAME) == [] and not monitor.describe()["running"]
    (line,) = logs  # the poll the stop cut short warns of nothing
    assert (line["event"], line["log_level"]) == (STOP_EVENT, "warning")
    assert line["abandoned"] == ["jtop"] and line["left_to_read"] is None
    assert line["waited_s"] < PROMPT_S
    assert sinks.events == [] and sinks.records == []  # nor publishes or records it
    assert opening.is_alive() and not state.clients[0].started
    with capture_logs() as late:
        released.set()  # the service answers, after the stop
        opening.join(HANG_S)
    assert not opening.is_alive()
    assert [(e["event"], e["source"], e["in_use"]) for e in late] == [
        ("thermal_source_open_abandoned", "jtop", None)
    ]
    assert state.clients[0].started and state.clients[0].closed and len(state.clients) == 1
    assert monitor.abandoned_opens == () and monitor.stop() is True


def test_a_stop_during_a_reprobes_open_does_not_wait_out_its_deadline(
    monkeypatch: pytest.MonkeyPatch, released: threading.Event
) -> None:
    """NVML in use fails; the re-probe's ``nvmlInit`` hangs, within its deadline
    (5 s at 20 Hz): the stop returns at once, and the init that returns later
    is shut down on its own thread."""
    state = fake_pynvml.FakeNvml(temperature_c=52)
    released.set()  # the first nvmlInit answers
    monkeypatch.setitem(sys.modules, "pynvml", hanging_nvml(state, released))
    sinks = Sinks()
    config = ThermalConfig(sources=("nvml",), throttle_enter_c=80.0, poll_hz=20.0)
    monitor = ThermalMonitor(
        config, events=sinks.event, record=sinks.record, reprobe_interval_s=0.2
    )
    monitor.start()
    wait_until(lambda: monitor.describe()["available"], message="NVML read")
    released.clear()  # the driver stops answering: the re-probe's init hangs
    state.errors["nvmlDeviceGetTemperature"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    wait_until(
        lambda: state.shutdown_calls == 1 and len(threads(OPEN_THREAD_NAME)) == 1,
        message="the re-probe's nvmlInit",  # NVML in use is shut down first
    )
    assert state.init_count == 0 and state.calls.count("nvmlInit") == 1  # the second hangs
    published = len(sinks.events)  # the poll waits for the open: it publishes nothing now
    stopped, took, logs = stop_timed(monitor)
    assert took < PROMPT_S, took
    assert stopped is False and monitor.abandoned_opens == ("nvml",)
    assert [(e["event"], e["log_level"], e["abandoned"]) for e in logs] == [
        (STOP_EVENT, "warning", ["nvml"])
    ]
    assert len(sinks.events) == published  # the poll the stop cut short: not published
    assert threads(THREAD_NAME) == []
    del state.errors["nvmlDeviceGetTemperature"]  # the probe read will pass
    (opening,) = threads(OPEN_THREAD_NAME)
    with capture_logs() as late:
        released.set()
        opening.join(HANG_S)
    assert not opening.is_alive()
    assert [(e["event"], e["source"]) for e in late] == [("thermal_source_open_abandoned", "nvml")]
    assert state.init_count == 0 and state.shutdown_calls == 2  # the late init: shut down once
    assert monitor.abandoned_opens == () and monitor.stop() is True


def test_a_stop_during_a_read_within_its_deadline_hands_nvml_to_the_read(
    monkeypatch: pytest.MonkeyPatch, released: threading.Event
) -> None:
    """Throttled on NVML, then a read hangs within its deadline: the stop used to
    wait its whole timeout (5.0 s) and leave NVML initialised for good.  Now it
    returns at once and the read's thread shuts NVML down when the read
    returns.  The poll it cut short records no transition: the stop is no
    loss of telemetry to write down."""
    state, hang = fake_pynvml.FakeNvml(reasons=fake_pynvml.SW_THERMAL), HangingReads(released)
    monkeypatch.setitem(sys.modules, "pynvml", nvml_whose_reads_hang(state, hang))
    sinks = Sinks()
    config = ThermalConfig(sources=("nvml",), throttle_enter_c=80.0, poll_hz=20.0)
    monitor = ThermalMonitor(config, events=sinks.event, record=sinks.record)
    monitor.start()
    wait_until(lambda: monitor.snapshot().thermal_throttle_active, message="throttled on NVML")
    hang.armed.set()
    assert hang.entered.wait(HANG_S)  # the poll waits for it, within its 5 s deadline
    reader = hang.thread
    assert reader is not None and reader.name == READ_THREAD_NAME
    stopped, took, logs = stop_timed(monitor)
    assert took < PROMPT_S, took
    assert stopped is False
    assert monitor.abandoned_read == "nvml" and monitor.abandoned_opens == ()
    assert state.init_count == 1 and state.shutdown_calls == 0  # the read still uses it
    (line,) = logs
    assert (line["event"], line["log_level"]) == (STOP_EVENT, "warning")
    assert line["left_to_read"] == "nvml" and line["abandoned"] == []
    assert [p["throttle_active"] for _, p in sinks.records] == [True]  # entered, never left
    assert threads(THREAD_NAME) == []
    with capture_logs() as late:
        released.set()  # the driver answers, after the stop
        reader.join(HANG_S)
    assert not reader.is_alive()
    assert [(e["event"], e["source"]) for e in late] == [("thermal_source_read_abandoned", "nvml")]
    assert state.init_count == 0 and state.shutdown_calls == 1  # by the read's thread, once
    assert monitor.abandoned_read is None and monitor.stop() is True
    assert state.shutdown_calls == 1


def test_a_stop_with_a_read_past_its_deadline_leaves_the_source_to_the_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read past its deadline used to cost the stop its whole timeout (5.0 s),
    then leave the source open.  Now the stop does not wait: the read's thread
    closes the source when the read returns, once, and ends."""
    source = HangingSource(reading(cpu=47.0), hang_from=2)  # the probe read, then a hang
    monkeypatch.setitem(OPENERS, "sysfs", lambda _config: source)
    monitor, _, _ = monitor_for(("sysfs",), poll_hz=20.0)  # 0.25 s deadline
    monitor.start()
    try:
        wait_until(
            lambda: "a read has not returned" in (monitor.describe()["last_error"] or ""),
            message="the read past its deadline",
        )
        (reader,) = threads(READ_THREAD_NAME)
        stopped, took, logs = stop_timed(monitor)
        assert took < PROMPT_S, took
        assert stopped is False and monitor.abandoned_read == "hanging"
        assert source.closed == 0  # the read still uses it
        (line,) = [e for e in logs if e["event"] == STOP_EVENT]
        assert (line["log_level"], line["left_to_read"], line["abandoned"]) == (
            "warning",
            "hanging",
            [],
        )
        with capture_logs() as late:
            source.release.set()
            reader.join(HANG_S)
    finally:
        source.release.set()
    assert not reader.is_alive() and threads(READ_THREAD_NAME) == []
    assert source.closed == 1  # by the read's thread
    assert [(e["event"], e["source"]) for e in late] == [
        ("thermal_source_read_abandoned", "hanging")
    ]
    assert monitor.abandoned_read is None and monitor.stop() is True
    assert source.closed == 1  # once
    assert source.reads == 2


def test_a_restart_while_a_left_read_runs_starts_no_second_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most one read thread, across a stop and a start: the read the stop
    left still runs, so the restarted monitor polls without reading (lost
    telemetry naming the source), and stops at once again."""
    source = HangingSource(reading(cpu=47.0), hang_from=2)
    monkeypatch.setitem(OPENERS, "sysfs", lambda _config: source)
    monitor, _, _ = monitor_for(("sysfs",), poll_hz=20.0)
    monitor.start()
    try:
        wait_until(lambda: source.reads == 2, message="the read that hangs")
        assert monitor.stop(THERMAL_S) is False and monitor.abandoned_read == "hanging"
        monitor.start()
        polls = monitor.describe()["polls"]
        wait_until(lambda: monitor.describe()["polls"] >= polls + 5, message="polls go on")
        assert monitor.describe()["last_error"].startswith("hanging: a read has not returned")
        assert source.reads == 2 and len(threads(READ_THREAD_NAME)) == 1
        assert len(threads(OPEN_THREAD_NAME)) == 0  # and no open: the read holds the sensor
        stopped, took, _ = stop_timed(monitor)
        assert stopped is False and took < PROMPT_S, took
        assert monitor.abandoned_read == "hanging"
    finally:
        source.release.set()
    for reader in threads(READ_THREAD_NAME):
        reader.join(HANG_S)
    assert source.closed == 1 and monitor.stop() is True


@pytest.fixture
def board(monkeypatch: pytest.MonkeyPatch) -> Iterator[Jetson]:
    board = Jetson(monkeypatch)
    yield board
    board.release.set()


def test_a_restart_after_a_stop_during_an_open_starts_no_second_open(board: Jetson) -> None:
    """At most one open thread per source, across a stop and a start: jtop's
    open the stop woke from still runs, so the restarted monitor reads NVML,
    and takes jtop back when ``start()`` returns, with one jtop client."""
    sinks = Sinks()
    config = ThermalConfig(sources=("jtop", "nvml"), throttle_enter_c=80.0, poll_hz=20.0)
    monitor = ThermalMonitor(config, events=sinks.event, stale_after_s=HANG_S)
    monitor.start()
    wait_until(lambda: len(board.jtop.clients) == 1, message="jtop's start() entered")
    stopped, took, _ = stop_timed(monitor)
    assert stopped is False and took < PROMPT_S and monitor.abandoned_opens == ("jtop",)
    monitor.start()
    try:
        wait_until(lambda: monitor.describe()["source"] == "nvml", message="NVML after the start")
        assert len(board.jtop.clients) == 1 and len(threads(OPEN_THREAD_NAME)) == 1
        board.release.set()
        wait_until(lambda: monitor.describe()["source"] == "jtop", message="jtop taken back")
    finally:
        board.release.set()
    assert len(board.jtop.clients) == 1 and board.nvml.shutdown_calls == 1
    assert monitor.stop() is True and board.jtop.clients[0].closed


class SlowSource(ScriptedSource):
    """A healthy sensor whose read takes ``SLOW_READ_S`` (an I2C transfer);
    ``reading`` says one has begun."""

    def __init__(self) -> None:
        super().__init__(reading(cpu=48.0), name="slow")
        self.reading = threading.Event()

    def read(self) -> ThermalReading:
        self.reading.set()
        time.sleep(SLOW_READ_S)  # the sensor's own time, not a synchronisation
        return super().read()


#: Well under ``READ_SETTLE_S``: a read a stop meets mid-way.
SLOW_READ_S = 0.03


def test_a_stop_in_the_middle_of_a_healthy_read_lets_it_return() -> None:
    """A stop that met a read in progress left it behind even when it returned
    a few milliseconds later: the stop returned False and warned
    ``left_to_read`` (a CI run of ``test_restart_after_stop_probes_again`` failed
    so).  A read in progress now has ``READ_SETTLE_S`` to return; the stop then
    closes the source itself and reports nothing left."""
    source = SlowSource()
    monitor, _, _ = make_monitor(source, ThermalConfig(poll_hz=1.0))
    monitor.start()
    assert source.reading.wait(HANG_S), "no read began"
    stopped, took, logs = stop_timed(monitor)
    assert stopped is True, logs
    assert [e for e in logs if e["event"] == STOP_EVENT] == []
    assert monitor.abandoned_read is None and source.closed == 1
    assert threads(READ_THREAD_NAME) == [] and took < PROMPT_S
