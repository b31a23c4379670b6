"""Alert hooks and the rate-limiting dispatcher (no daemon, no ZeroMQ)."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any, get_args

import pytest
from structlog.testing import capture_logs

from inferd.alerts import (
    LEVELS,
    AlertDispatcher,
    AlertHookUnavailableError,
    FdrAlertHook,
    PubAlertHook,
    build_alert_hooks,
    log_method,
    mav_severity,
)
from inferd.alerts.mavlink import (
    STATUSTEXT_LEN,
    MavlinkAlertHook,
    repeats_suffix,
    statustext_chunks,
)
from inferd.config import AlertsConfig
from inferd.types import Alert, AlertLevel

ALL_LEVELS: tuple[AlertLevel, ...] = get_args(AlertLevel)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingHook:
    def __init__(self, name: str = "recording") -> None:
        self.name = name
        self.calls: list[tuple[str, str, str, dict[str, Any]]] = []
        self.closed = False
        self._lock = threading.Lock()

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        with self._lock:
            self.calls.append((level, code, message, dict(fields)))

    def close(self) -> None:
        self.closed = True


class FailingHook(RecordingHook):
    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        super().alert(level, code, message, fields)
        raise ConnectionError("ground link down")

    def close(self) -> None:
        self.closed = True
        raise OSError("close failed")


def alert(
    code: str = "c7.test_alert", model: str | None = "demo", level: AlertLevel = "WARNING"
) -> Alert:
    fields = {} if model is None else {"model": model}
    return Alert(level, code, f"something about {model}", fields)


# -- severity mapping -------------------------------------------------------
def test_levels_cover_every_alert_level_in_severity_order() -> None:
    assert tuple(LEVELS) == ALL_LEVELS
    assert [mav_severity(level) for level in ALL_LEVELS] == list(range(8))


def test_severities_match_pymavlink_constants() -> None:
    from pymavlink.dialects.v20 import common

    for level in ALL_LEVELS:
        assert mav_severity(level) == getattr(common, f"MAV_SEVERITY_{level}")


def test_log_methods() -> None:
    assert {level: log_method(level) for level in ALL_LEVELS} == {
        "EMERGENCY": "critical",
        "ALERT": "critical",
        "CRITICAL": "critical",
        "ERROR": "error",
        "WARNING": "warning",
        "NOTICE": "info",
        "INFO": "info",
        "DEBUG": "debug",
    }


def test_unknown_level_is_refused_by_the_table() -> None:
    with pytest.raises(ValueError, match="unknown alert level 'FATAL'"):
        mav_severity("FATAL")  # type: ignore[arg-type]


# -- PUB and FDR hooks ------------------------------------------------------
def test_pub_hook_publishes_the_four_keys() -> None:
    published: list[tuple[str, Mapping[str, Any]]] = []
    hook = PubAlertHook(lambda topic, payload: published.append((topic, payload)))
    hook.alert("ERROR", "c7.model_unavailable", "no runtime", {"model": "demo"})
    hook.alert("ERROR", "c7.model_unavailable", "no runtime", {"model": "demo", "suppressed": 3})
    assert published == [
        (
            "alert",
            {
                "level": "ERROR",
                "code": "c7.model_unavailable",
                "message": "no runtime",
                "fields": {"model": "demo"},
            },
        ),
        (
            "alert",
            {
                "level": "ERROR",
                "code": "c7.model_unavailable",
                "message": "no runtime",
                "fields": {"model": "demo", "suppressed": 3},
            },
        ),
    ]
    assert type(published[0][1]["fields"]) is dict  # msgpack cannot pack a mappingproxy


def test_fdr_hook_records_c7_alert_with_suppressed_as_its_own_key() -> None:
    records: list[tuple[str, Mapping[str, Any]]] = []
    hook = FdrAlertHook(lambda kind, payload: records.append((kind, payload)))
    hook.alert("WARNING", "c7.cpu_fallback", "on CPU", {"model": "demo", "suppressed": 2})
    hook.alert("INFO", "c7.note", "plain", {})
    assert records == [
        (
            "c7.alert",
            {
                "level": "WARNING",
                "code": "c7.cpu_fallback",
                "message": "on CPU",
                "fields": {"model": "demo"},
                "suppressed": 2,
            },
        ),
        (
            "c7.alert",
            {"level": "INFO", "code": "c7.note", "message": "plain", "fields": {}, "suppressed": 0},
        ),
    ]
    assert set(records[0][1]) == {"level", "code", "message", "fields", "suppressed"}


# -- STATUSTEXT text ----------------------------------------------------------
def test_short_text_is_one_unchunked_message() -> None:
    assert statustext_chunks("c7.x: short") == [b"c7.x: short"]
    exactly = "x" * STATUSTEXT_LEN
    assert statustext_chunks(exactly) == [exactly.encode()]


def test_long_text_is_split_into_50_byte_chunks_ending_short() -> None:
    text = "".join(chr(ord("a") + index % 26) for index in range(120))
    chunks = statustext_chunks(text)
    assert [len(chunk) for chunk in chunks] == [50, 50, 20]
    assert b"".join(chunks).decode() == text


def test_multiple_of_50_gets_a_terminating_space() -> None:
    text = "y" * 100
    chunks = statustext_chunks(text)
    assert [len(chunk) for chunk in chunks] == [50, 50, 1]
    assert b"".join(chunks) == text.encode() + b" "


def test_text_over_the_chunk_budget_is_cut_with_ellipsis_keeping_the_suffix() -> None:
    suffix = repeats_suffix(7)
    chunks = statustext_chunks("z" * 500, suffix=suffix, max_chunks=3)
    joined = b"".join(chunks).decode()
    assert len(joined) == 3 * STATUSTEXT_LEN - 1
    assert joined.endswith("z..." + " (+7 repeats)")
    assert len(chunks[-1]) < STATUSTEXT_LEN


def test_mavlink1_budget_is_one_message_of_50() -> None:
    chunks = statustext_chunks("c7.fallback_to_onnx_trt_ep: " + "m" * 80, max_chunks=1)
    assert len(chunks) == 1
    assert len(chunks[0]) == STATUSTEXT_LEN
    assert chunks[0].endswith(b"m...")


def test_text_is_one_line_of_printable_ascii() -> None:
    (chunk,) = statustext_chunks("caf\u00e9 \u00b0C\nnext\x00line\tend")
    assert chunk == b"cafe ?C next?line end"


def test_no_repeats_no_suffix() -> None:
    assert repeats_suffix(0) == ""
    assert repeats_suffix(2) == " (+2 repeats)"


# -- MAVLink hook over a real UDP socket -----------------------------------------
@pytest.fixture
def udp_listener() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5.0)
    yield sock
    sock.close()


def _parse(datagram: bytes, version: int = 2) -> Any:
    if version == 2:
        from pymavlink.dialects.v20 import common
    else:
        from pymavlink.dialects.v10 import common
    parser = common.MAVLink(None)
    messages = parser.parse_buffer(datagram)
    assert messages is not None and len(messages) == 1
    return messages[0]


def test_mavlink_hook_sends_statustext_v2(udp_listener: socket.socket) -> None:
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{port}", 7, 191)
    try:
        hook.alert("CRITICAL", "c7.test_alert", "engine lost", {"model": "demo"})
        datagram = udp_listener.recv(512)
    finally:
        hook.close()
    assert datagram[0] == 0xFD  # MAVLink 2 magic
    message = _parse(datagram)
    assert message.get_type() == "STATUSTEXT"
    assert (message.get_srcSystem(), message.get_srcComponent()) == (7, 191)
    assert message.severity == 2
    assert message.text == "c7.test_alert: engine lost"
    assert (message.id, message.chunk_seq) == (0, 0)


def test_mavlink_hook_chunks_share_a_nonzero_id(udp_listener: socket.socket) -> None:
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{port}")
    long_message = "the configured runtime tensorrt cannot serve model demo: " + "x" * 40
    try:
        hook.alert("WARNING", "c7.fallback_to_onnx_trt_ep", long_message, {"suppressed": 4})
        hook.alert("WARNING", "c7.fallback_to_onnx_trt_ep", long_message, {})
        first = [_parse(udp_listener.recv(512)) for _ in range(3)]
        second = [_parse(udp_listener.recv(512)) for _ in range(3)]
    finally:
        hook.close()
    expected = f"c7.fallback_to_onnx_trt_ep: {long_message} (+4 repeats)"
    assert "".join(message.text for message in first) == expected
    assert [message.chunk_seq for message in first] == [0, 1, 2]
    assert len({message.id for message in first}) == 1 and first[0].id != 0
    assert second[0].id not in (0, first[0].id)
    assert all(message.severity == 4 for message in first + second)


def test_mavlink1_hook_truncates_and_uses_v1_frames(udp_listener: socket.socket) -> None:
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{port}", mavlink2=False)
    try:
        hook.alert("ERROR", "c7.model_unavailable", "m" * 80, {})
        datagram = udp_listener.recv(512)
    finally:
        hook.close()
    assert datagram[0] == 0xFE  # MAVLink 1 magic
    message = _parse(datagram, version=1)
    assert message.severity == 3
    assert len(message.text) == STATUSTEXT_LEN
    assert message.text.startswith("c7.model_unavailable: mmm")
    assert message.text.endswith("...")


def test_mavlink_hook_close_closes_the_socket_and_later_alerts_are_dropped(
    udp_listener: socket.socket,
) -> None:
    port = udp_listener.getsockname()[1]
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{port}")
    sock = hook._connection.port
    hook.close()
    assert sock.fileno() == -1
    hook.alert("ERROR", "c7.after_close", "dropped", {})
    hook.close()  # idempotent
    udp_listener.settimeout(0.2)
    with pytest.raises(TimeoutError):
        udp_listener.recv(512)


def test_mavlink_hook_without_pymavlink_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pymavlink", None)
    with pytest.raises(AlertHookUnavailableError, match="pymavlink is not installed") as info:
        MavlinkAlertHook("udpout:127.0.0.1:14550")
    assert info.value.hook == "mavlink"


def test_mavlink_hook_bad_endpoint_is_unavailable() -> None:
    with pytest.raises(AlertHookUnavailableError, match="cannot open MAVLink endpoint"):
        MavlinkAlertHook("udpout:no-port-here")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source_system": 0}, "source_system"),
        ({"source_component": 256}, "source_component"),
        ({"max_chunks": 0}, "max_chunks"),
    ],
)
def test_mavlink_hook_validates_its_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MavlinkAlertHook("udpout:127.0.0.1:14550", **kwargs)


# -- dispatcher: rate limit and dedup ---------------------------------------------
def test_first_goes_out_repeats_are_counted_and_reported_after_the_window() -> None:
    clock, hook = FakeClock(), RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    dispatcher(alert())
    clock.now += 3
    dispatcher(alert())
    clock.now += 6.75
    dispatcher(alert())
    assert len(hook.calls) == 1
    assert "suppressed" not in hook.calls[0][3]
    clock.now += 0.25  # exactly 10 s after the first: the window has passed
    dispatcher(alert())
    assert len(hook.calls) == 2
    assert hook.calls[1][3] == {"model": "demo", "suppressed": 2}
    clock.now += 1
    dispatcher(alert())  # a new window opened at the second delivery
    assert len(hook.calls) == 2
    status = dispatcher.status()
    assert (status["raised"], status["sent"], status["suppressed"], status["pending"]) == (
        5,
        2,
        3,
        1,
    )


def test_different_models_and_codes_do_not_suppress_each_other() -> None:
    clock, hook = FakeClock(), RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    dispatcher(alert(model="front"))
    dispatcher(alert(model="rear"))
    dispatcher(alert(model=None))
    dispatcher(alert(code="c7.other", model="front"))
    dispatcher(alert(model="front"))
    assert [(call[1], call[3].get("model")) for call in hook.calls] == [
        ("c7.test_alert", "front"),
        ("c7.test_alert", "rear"),
        ("c7.test_alert", None),
        ("c7.other", "front"),
    ]


def test_zero_rate_limit_sends_everything() -> None:
    hook = RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=0.0, clock=FakeClock())
    for _ in range(5):
        dispatcher(alert())
    assert len(hook.calls) == 5
    assert all("suppressed" not in call[3] for call in hook.calls)


def test_flush_reports_a_burst_that_stopped_only_after_its_window() -> None:
    clock, hook = FakeClock(), RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    dispatcher(alert())
    dispatcher(alert())
    dispatcher(alert())
    clock.now += 5
    assert dispatcher.flush() == 0
    clock.now += 5
    assert dispatcher.flush() == 1
    assert hook.calls[-1][3] == {"model": "demo", "suppressed": 1}
    assert dispatcher.flush() == 0
    status = dispatcher.status()
    assert status["raised"] == status["sent"] + status["suppressed"] == 3


def test_close_flushes_pending_repeats_closes_hooks_and_drops_later_alerts() -> None:
    clock, hook, failing = FakeClock(), RecordingHook(), FailingHook("failing")
    dispatcher = AlertDispatcher([hook, failing], rate_limit_s=10.0, clock=clock)
    dispatcher(alert())
    dispatcher(alert())
    dispatcher.close()  # a hook whose close() raises does not stop the others
    assert hook.closed and failing.closed
    assert len(hook.calls) == 2
    with capture_logs() as logs:
        dispatcher(alert(model="late"))
    assert len(hook.calls) == 2
    assert logs[-1]["delivered"] is False
    status = dispatcher.status()
    assert status["closed"] and status["dropped_after_close"] == 1
    assert status["raised"] == status["sent"] + status["suppressed"] + 1
    dispatcher.close()  # idempotent


def test_hooks_get_a_read_only_view_and_raisers_cannot_fake_suppressed() -> None:
    seen: list[Mapping[str, Any]] = []

    class Mutating(RecordingHook):
        def alert(
            self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]
        ) -> None:
            seen.append(fields)
            fields["model"] = "changed"  # type: ignore[index]

    hook = RecordingHook()
    dispatcher = AlertDispatcher([Mutating("mutating"), hook], clock=FakeClock())
    dispatcher(Alert("INFO", "c7.x", "m", {"model": "demo", "suppressed": 99}))
    assert hook.calls == [("INFO", "c7.x", "m", {"model": "demo"})]
    assert dispatcher.status()["hooks"]["mutating"]["failures"] == 1


def test_unknown_level_is_delivered_as_error() -> None:
    hook = RecordingHook()
    dispatcher = AlertDispatcher([hook], clock=FakeClock())
    dispatcher(Alert("FATAL", "c7.x", "m"))  # type: ignore[arg-type]
    assert hook.calls == [("ERROR", "c7.x", "m", {})]


# -- dispatcher: failure isolation ------------------------------------------------
def test_a_failing_hook_never_breaks_the_caller_or_the_other_hooks() -> None:
    clock = FakeClock()
    before, failing, after = RecordingHook("before"), FailingHook("failing"), RecordingHook("after")
    dispatcher = AlertDispatcher([before, failing, after], rate_limit_s=10.0, clock=clock)
    with capture_logs() as logs:
        dispatcher(alert(model="a"))
        dispatcher(alert(model="b"))
        dispatcher(alert(model="c"))
        clock.now += 10
        dispatcher(alert(model="d"))
    assert len(before.calls) == len(after.calls) == len(failing.calls) == 4
    errors = [entry for entry in logs if entry["event"] == "alert_hook_failed"]
    assert [entry["failures_since_last_log"] for entry in errors] == [1, 3]
    assert all(entry["log_level"] == "error" and entry["hook"] == "failing" for entry in errors)
    hooks = dispatcher.status()["hooks"]
    assert hooks["failing"] == {
        "sent": 0,
        "failures": 4,
        "last_error": "ConnectionError('ground link down')",
    }
    assert hooks["before"]["sent"] == hooks["after"]["sent"] == 4


def test_duplicate_hook_names_are_told_apart() -> None:
    dispatcher = AlertDispatcher([RecordingHook("x"), RecordingHook("x")])
    assert dispatcher.hook_names == ("x", "x#2")


# -- dispatcher: logging -------------------------------------------------------------
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_each_delivered_alert_is_logged_once_at_its_level(level: AlertLevel) -> None:
    dispatcher = AlertDispatcher([RecordingHook(), RecordingHook()], clock=FakeClock())
    with capture_logs() as logs:
        dispatcher(alert(level=level))
        dispatcher(alert(level=level))  # suppressed: debug only
    alerts = [entry for entry in logs if entry["event"] == "alert"]
    assert len(alerts) == 1
    assert alerts[0]["log_level"] == log_method(level)
    assert alerts[0]["alert_code"] == "c7.test_alert"
    assert alerts[0]["alert_level"] == level
    assert alerts[0]["alert_fields"] == {"model": "demo"}
    suppressed = [entry for entry in logs if entry["event"] == "alert_suppressed"]
    assert [entry["log_level"] for entry in suppressed] == ["debug"]


# -- dispatcher: threads ------------------------------------------------------------
def test_concurrent_alerts_are_each_delivered_or_counted() -> None:
    clock, hook = FakeClock(), RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    threads, per_thread, models = 8, 500, ("a", "b", "c")
    start = threading.Barrier(threads)

    def worker(index: int) -> None:
        start.wait()
        for count in range(per_thread):
            dispatcher(alert(model=models[(index + count) % len(models)]))

    workers = [threading.Thread(target=worker, args=(index,)) for index in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in workers)
    assert len(hook.calls) == len(models)  # clock stood still: one per key
    clock.now += 10
    assert dispatcher.flush() == len(models)
    raised = threads * per_thread
    status = dispatcher.status()
    assert status["raised"] == raised
    assert status["sent"] == len(hook.calls) == 2 * len(models)
    reported = len(hook.calls) + sum(call[3].get("suppressed", 0) for call in hook.calls)
    assert reported == raised
    assert status["hooks"]["recording"]["sent"] == 2 * len(models)


# -- factory ------------------------------------------------------------------------
def test_factory_builds_hooks_in_configured_order(udp_listener: socket.socket) -> None:
    port = udp_listener.getsockname()[1]
    config = AlertsConfig(
        hooks=("mavlink", "fdr", "pub"), mavlink_endpoint=f"udpout:127.0.0.1:{port}"
    )
    hooks = build_alert_hooks(config, events=lambda *_: None, record=lambda *_: None)
    try:
        assert [type(hook) for hook in hooks] == [MavlinkAlertHook, FdrAlertHook, PubAlertHook]
        assert [getattr(hook, "name", None) for hook in hooks] == ["mavlink", "fdr", "pub"]
    finally:
        for hook in hooks:
            hook.close()


def test_factory_refuses_unbuildable_hooks_without_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pymavlink", None)
    refused: list[tuple[str, str]] = []
    with capture_logs() as logs:
        hooks = build_alert_hooks(
            AlertsConfig(hooks=("fdr", "mavlink", "pub")),
            events=lambda *_: None,
            record=None,
            on_refused=lambda hook, reason: refused.append((hook, reason)),
        )
    assert [type(hook) for hook in hooks] == [PubAlertHook]
    assert [hook for hook, _ in refused] == ["fdr", "mavlink"]
    assert "pymavlink is not installed" in refused[1][1]
    assert [entry["hook"] for entry in logs if entry["event"] == "alert_hook_refused"] == [
        "fdr",
        "mavlink",
    ]


def test_alerts_package_imports_no_bus_service_or_pymavlink() -> None:
    import subprocess

    code = (
        "import sys, inferd.alerts; "
        "bad = [m for m in sys.modules if m.startswith(('zmq', 'inferd.bus', "
        "'inferd.service', 'pymavlink'))]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
