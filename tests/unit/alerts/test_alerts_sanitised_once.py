"""Every hook and the ``alert`` log line get the same bounded, encodable alert:
the dispatcher sanitises it once (``inferd.alerts.sanitise``).

Before, only the fdr hook sanitised, and only after the recorder refused: the
PUB hook handed an alert with a lone surrogate to the publisher, which could not
encode it and dropped it (the ground station never saw it); a 1 MB message went
whole to the MAVLink hook and into the log line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher, FdrAlertHook, PubAlertHook, sanitise
from inferd.alerts import dispatcher as dispatcher_module
from inferd.bus.publisher import EventPublisher
from inferd.fdr import framing
from inferd.types import Alert, AlertLevel
from inferd_wire.protocol import unpack_header
from tests.conftest import HANG_S, examples
from tests.integration.test_schemas import assert_valid

#: A path as ``os.fsdecode`` gives it for a Latin-1 file name: a lone surrogate.
ENGINE = os.fsdecode(b"/var/lib/inferd/engines/det\xe9ctor.engine")
ESCAPED = "/var/lib/inferd/engines/det\\udce9ctor.engine"
MEGABYTE = "cannot serve: " + "y" * (1 << 20)
CUT = f" [cut: {len(MEGABYTE)} characters]"


def _failover(engine: str) -> Alert:
    fields = {"model": "cam", "failures": 3, "sticky": False, "engine": engine}
    return Alert(
        "ERROR", "tensorrt_execution_failover", "failed over", fields | {"quarantined": None}
    )


class RecordingHook:
    """A hook that keeps what it was handed (as the MAVLink hook is)."""

    name = "mavlink"

    def __init__(self) -> None:
        self.got: list[tuple[str, str, str, dict[str, Any]]] = []

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        self.got.append((level, code, message, dict(fields)))

    def close(self) -> None:
        pass


@pytest.fixture
def events(short_tmp_path: Path) -> Iterator[tuple[EventPublisher, zmq.Socket[Any]]]:
    """A real publisher, and an XSUB that has joined it for ``alert`` events."""
    context: zmq.Context[Any] = zmq.Context()
    endpoint = f"ipc://{short_tmp_path}/events.sock"
    publisher = EventPublisher(
        context, endpoint, health=lambda: {"state": "serving"}, health_interval_s=0.05
    )
    publisher.start()
    publisher.wait_bound(HANG_S)
    sock = context.socket(zmq.XSUB)
    sock.connect(endpoint)
    sock.send(b"\x01alert")
    sock.send(b"\x01health")
    try:
        while True:  # a health event: both subscriptions (in order) are applied
            assert sock.poll(int(HANG_S * 1000)), "no health event"
            if sock.recv_multipart()[0] == b"health":
                break
        yield publisher, sock
    finally:
        publisher.stop()
        publisher.join(HANG_S)
        context.destroy(linger=0)


def test_an_alert_with_a_lone_surrogate_reaches_the_pub_socket(
    events: tuple[EventPublisher, zmq.Socket[Any]],
) -> None:
    publisher, sock = events
    dispatcher = AlertDispatcher([PubAlertHook(publisher.publish)])
    dispatcher(_failover(ENGINE))
    dispatcher(Alert("ERROR", "model_unavailable", "plain", {"model": "after"}))
    alerts: list[dict[str, Any]] = []
    while not alerts or alerts[-1]["fields"]["model"] != "after":  # events go out in order
        assert sock.poll(int(HANG_S * 1000)), f"no alert for the model 'after'; got {alerts}"
        topic, payload = sock.recv_multipart()
        if topic == b"alert":
            alerts.append(unpack_header(payload, check_version=False))
    assert [alert["fields"]["model"] for alert in alerts] == ["cam", "after"]  # before: ["after"]
    assert alerts[0]["fields"]["engine"] == ESCAPED
    assert "sanitised" not in alerts[0]["fields"]  # the schema allows it for no code
    for alert in alerts:
        assert_valid("event_alert.json", alert)
    assert publisher.dropped == 0  # before: 1


def test_a_megabyte_message_reaches_every_hook_and_the_log_line_bounded() -> None:
    mavlink = RecordingHook()
    published: list[Mapping[str, Any]] = []
    records: list[Mapping[str, Any]] = []
    dispatcher = AlertDispatcher(
        [
            mavlink,
            PubAlertHook(lambda _topic, payload: published.append(payload)),
            FdrAlertHook(lambda _kind, payload: records.append(payload)),
        ]
    )
    with capture_logs() as logs:
        dispatcher(Alert("CRITICAL", "engine_worker_died", MEGABYTE, {"queued": 0}))
    ((_level, _code, message, fields),) = mavlink.got
    assert message == MEGABYTE[: sanitise.MESSAGE_BYTES] + CUT  # before: all 1,048,590
    assert [payload["message"] for payload in published + records] == [message, message]
    (line,) = [entry for entry in logs if entry["event"] == "alert"]
    assert line["alert_message"] == message
    assert fields["sanitised"] == {"reason": "a string over its limit", "changed": ["message"]}
    assert dispatcher.status()["hooks"]["mavlink"] == {"sent": 1, "failures": 0, "last_error": None}


def test_the_fdr_record_carries_the_marker_the_event_does_not() -> None:
    published: list[Mapping[str, Any]] = []
    records: list[Mapping[str, Any]] = []
    mavlink = RecordingHook()
    dispatcher = AlertDispatcher(
        [
            PubAlertHook(lambda _topic, payload: published.append(payload)),
            FdrAlertHook(lambda _kind, payload: records.append(payload)),
            mavlink,
        ],
        rate_limit_s=60.0,
    )
    with capture_logs() as logs:
        dispatcher(_failover(ENGINE))
        dispatcher(_failover(ENGINE))  # held back; the flush at close sends it
        dispatcher.close()
    marker = {"reason": "a lone surrogate (not UTF-8)", "changed": ["fields.engine"]}
    assert [record.get("sanitised") for record in records] == [marker, marker]  # before: none
    assert [record["fields"]["engine"] for record in records] == [ESCAPED, ESCAPED]
    assert ["sanitised" in record["fields"] for record in records] == [False, False]
    assert [record["suppressed"] for record in records] == [0, 0]
    assert [set(event["fields"]) for event in published] == [
        {"model", "failures", "sticky", "engine", "quarantined"}
    ] * 2
    assert [event["fields"]["engine"] for event in published] == [ESCAPED, ESCAPED]
    assert [fields["engine"] for *_rest, fields in mavlink.got] == [ESCAPED, ESCAPED]
    lines = [entry for entry in logs if entry["event"] == "alert"]
    assert [line["alert_fields"]["sanitised"] for line in lines] == [marker, marker]
    for record in records:
        framing.encode_record_parts("alert", 1, 0, 0, "boot", record, segment_max_bytes=1 << 20)


def test_a_raisers_own_sanitised_field_is_dropped() -> None:
    """``sanitised`` is the dispatcher's key, as ``suppressed`` is."""
    published: list[Mapping[str, Any]] = []
    records: list[Mapping[str, Any]] = []
    dispatcher = AlertDispatcher(
        [
            PubAlertHook(lambda _topic, payload: published.append(payload)),
            FdrAlertHook(lambda _kind, payload: records.append(payload)),
        ]
    )
    dispatcher(Alert("WARNING", "note", "plain", {"model": "m", "sanitised": "by me"}))
    assert published[0]["fields"] == {"model": "m"}  # before: with "sanitised"
    assert "sanitised" not in records[0]  # before: "by me", a record the schema refuses


def test_repeats_held_back_are_not_sanitised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what is delivered is sanitised: a storm of repeats costs the rate
    limit alone (each sanitising of a megabyte message costs about 10 us)."""
    calls: list[str] = []

    def counting(code: str, message: str, fields: Mapping[str, Any]) -> Any:
        calls.append(code)
        return sanitise.sanitised(code, message, fields)

    monkeypatch.setattr(dispatcher_module, "sanitised", counting)
    mavlink = RecordingHook()
    dispatcher = AlertDispatcher([mavlink], rate_limit_s=60.0)
    for _ in range(100):
        dispatcher(Alert("CRITICAL", "engine_worker_died", MEGABYTE, {"queued": 0}))
    dispatcher.close()  # sends the last repeat held back
    assert len(calls) == 2  # the first and the flushed repeat, not the 98 held back
    assert [fields.get("suppressed") for *_rest, fields in mavlink.got] == [None, 98]
    assert {message for _level, _code, message, _fields in mavlink.got} == {
        MEGABYTE[: sanitise.MESSAGE_BYTES] + CUT
    }


@pytest.mark.parametrize(
    "alert",
    [
        _failover("/var/lib/inferd/engines/cam0.engine"),
        Alert(
            "WARNING",
            "fallback_to_onnx_trt_ep",
            "modèle démo sur ONNX Runtime",
            {
                "model": "demo",
                "model_sha256": "a" * 64,
                "active_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
            },
        ),
        Alert("INFO", "note", "nested", {"a": {"b": [1, 2.5, None, True]}, "t": (1, "x")}),
        Alert("INFO", "note", "no fields"),
    ],
    ids=["failover", "fallback", "nested", "empty"],
)
def test_an_alert_that_needs_no_change_is_not_copied(alert: Alert) -> None:
    assert dispatcher_module._sanitised(alert) is alert
    assert sanitise.sanitised(alert.code, alert.message, alert.fields) is None


def test_a_sanitised_alert_stays_within_its_bounds() -> None:
    many = {
        f"k{index}": [index, {"deep": {"deeper": {"deepest": [index]}}}] for index in range(300)
    }
    clean = sanitise.sanitised("c" * 200, "m" * 5000, many | {"huge": 1 << 70})
    assert clean is not None
    assert clean.code == "c" * 128 + " [cut: 200 characters]"
    assert clean.changed[:2] == ["code", "message"]
    assert clean.changed[-1] == "fields"
    assert _values(clean.fields) == sanitise.MAX_VALUES
    assert clean.fields["k0"][1]["deep"]["deeper"] == repr({"deepest": [0]})  # a 4th level
    assert clean.reason == "a string over its limit; over 64 values; nested deeper than 3 levels"


def _values(node: Any) -> int:
    items = node.values() if isinstance(node, dict) else node
    return sum(1 + (_values(item) if isinstance(item, (dict, list)) else 0) for item in items)


def _long(limit: int) -> st.SearchStrategy[str]:
    """Strings about ``limit`` characters long, some with a lone surrogate near the
    limit (built, not drawn character by character: drawing them took seconds)."""
    return st.builds(
        lambda length, tail: "a" * length + tail,
        st.integers(limit - 3, limit + 2),
        st.sampled_from(["", "\udce9", "é", "\U0001f600"]),
    )


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)  # lone surrogates among them
    | _long(sanitise.VALUE_BYTES)
    | st.binary(max_size=4)
    | st.builds(Path, st.text(alphabet="ab/", max_size=5))
)
_KEYS = st.text(max_size=8) | st.integers(0, 3) | _long(sanitise.KEY_BYTES)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(_KEYS, children, max_size=4)
        | st.dictionaries(st.text(max_size=4), children, max_size=3).map(MappingProxyType)
    ),
    max_leaves=20,
)


@settings(max_examples=examples(200), deadline=None)
@given(
    code=st.text(max_size=10) | _long(sanitise.KEY_BYTES),
    message=st.text(max_size=30) | _long(sanitise.MESSAGE_BYTES),
    fields=st.dictionaries(_KEYS, _VALUES, max_size=6)
    | st.integers(250, 260).map(lambda count: {f"k{index}": index for index in range(count)}),
)
def test_what_hooks_get_can_be_sent_by_each(
    code: str, message: str, fields: dict[Any, Any]
) -> None:
    clean = sanitise.sanitised(code, message, fields)
    if clean is None:  # the quick check let it through: the full walk must agree
        code_out, message_out, fields_out = code, message, fields
        assert sanitise._Sanitiser().alert(code, message, fields) is None
    else:
        code_out, message_out, fields_out = clean.code, clean.message, clean.fields
        assert bool(clean.changed) == bool(clean.reason)
    payload = {"code": code_out, "message": message_out, "fields": fields_out}
    packed = msgpack.packb(payload, use_bin_type=True)  # the publisher's and recorder's packer
    assert msgpack.unpackb(packed, raw=False, strict_map_key=True)["code"] == code_out
    json.dumps(payload)  # what every consumer of a record does with it
    # The limits are bytes of UTF-8 (before the cut's note).
    assert len(code_out.encode()) <= sanitise.KEY_BYTES + len(" [cut: 999 characters]")
    assert len(message_out.encode()) <= sanitise.MESSAGE_BYTES + len(" [cut: 9999 characters]")
    assert _values(json.loads(json.dumps(fields_out))) <= sanitise.MAX_VALUES


class Unreadable(Mapping[str, Any]):
    """A map in ``fields`` that cannot be read (a raiser's bug)."""

    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("cannot be read")

    def __len__(self) -> int:
        return 1


def test_an_alert_whose_fields_cannot_be_read_is_still_delivered() -> None:
    mavlink = RecordingHook()
    dispatcher = AlertDispatcher([mavlink])
    dispatcher(Alert("ERROR", "note", f"at {ENGINE}", {"model": "m", "map": Unreadable()}))
    ((_level, code, message, fields),) = mavlink.got
    assert (code, message) == ("note", f"at {ESCAPED}")
    assert fields == {
        "sanitised": {
            "reason": "fields cannot be read: RuntimeError('cannot be read')",
            "changed": ["message", "fields"],
        }
    }
