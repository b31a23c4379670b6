"""The build pipe codec (``inferd.engine_build.pipe``): each message kind and the
cancel op round-trip, a malformed message is refused (logged, counted, skipped),
and a message split across reads decodes."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from structlog.testing import capture_logs

from inferd.engine_build.events import BuildEvent
from inferd.engine_build.pipe import (
    CancelCommand,
    ChildMessage,
    EnginePathMessage,
    ErrorMessage,
    EventMessage,
    MalformedMessage,
    RecordMessage,
    ReportMessage,
    child_message_decoder,
    command_decoder,
    encode,
    event_from_dict,
)


def _event(**changes: Any) -> BuildEvent:
    fields: dict[str, Any] = {
        "build_id": "b1-abc",
        "seq": 3,
        "type": "step",
        "phase_id": "p2",
        "parent_id": "p1",
        "name": "tactics",
        "step": 4,
        "num_steps": 10,
        "mono_ns": 123_456_789,
        "wall_ns": 1_700_000_000_000_000_000,
        "thread": "builder-0",
        "cancel_state": "none",
        "detail": {"layer": "conv1", "ms": 1.5},
    }
    fields.update(changes)
    return BuildEvent(**fields)


MESSAGES: list[ChildMessage] = [
    EventMessage(_event()),
    EventMessage(_event(phase_id=None, parent_id=None, name=None, step=None, detail={})),
    EnginePathMessage("/var/lib/inferd/engines/demo.engine"),
    RecordMessage({"model": "demo", "outcome": "succeeded", "duration_s": 1.25}),
    ReportMessage({"outcome": "completed", "phases": [1, 2]}, "/tmp/summary.json", 7),
    ErrorMessage("RuntimeError: no GPU"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_each_child_message_round_trips(message: ChildMessage) -> None:
    decoder = child_message_decoder()
    assert decoder.feed(encode(message)) == [message]
    assert decoder.malformed == 0


def test_wire_form_of_each_kind() -> None:
    kinds = [msgpack.unpackb(encode(m), raw=False)["kind"] for m in MESSAGES]
    assert kinds == ["event", "event", "engine_path", "record", "report", "error"]
    report = msgpack.unpackb(encode(MESSAGES[4]), raw=False)
    assert report == {
        "kind": "report",
        "summary": {"outcome": "completed", "phases": [1, 2]},
        "summaryPath": "/tmp/summary.json",
        "droppedInChild": 7,
    }


def test_cancel_op_round_trips() -> None:
    command = CancelCommand("ide", "stop button")
    assert msgpack.unpackb(encode(command), raw=False) == {
        "op": "cancel",
        "source": "ide",
        "reason": "stop button",
    }
    decoder = command_decoder()
    assert decoder.feed(encode(command)) == [command]
    # Defaults for a cancel op that names neither.
    assert decoder.feed(msgpack.packb({"op": "cancel"})) == [CancelCommand("control", "")]


def test_event_from_dict_inverts_as_dict() -> None:
    for event in (_event(), _event(detail={}, step=None)):
        assert event_from_dict(event.as_dict()) == event
        assert event_from_dict(event.as_dict()).as_dict() == event.as_dict()


@pytest.mark.parametrize(
    "data",
    [
        {"seq": 1},  # most fields missing
        {**_event().as_dict(), "seq": "3"},  # mistyped
        {**_event().as_dict(), "step": True},  # a bool is not a step index
        {**_event().as_dict(), "detail": [1]},
    ],
)
def test_event_from_dict_refuses_what_as_dict_never_makes(data: dict[str, Any]) -> None:
    with pytest.raises(MalformedMessage):
        event_from_dict(data)


def test_malformed_messages_are_logged_counted_and_skipped() -> None:
    good = EnginePathMessage("/e.engine")
    bad = [
        [1, 2, 3],  # not a map
        {"kind": "nonsense"},
        {"kind": "event", "event": {"seq": 1}},
        {"kind": "event"},
        {"kind": "report", "summary": "not a map", "summaryPath": "/s.json"},
        {"kind": "engine_path", "path": 5},
    ]
    stream = b"".join(msgpack.packb(obj) for obj in bad) + encode(good)
    decoder = child_message_decoder(build_id="b1-abc")
    with capture_logs() as logs:
        assert decoder.feed(stream) == [good]
    assert decoder.malformed == len(bad)
    refused = [e for e in logs if e["event"] == "build_pipe_malformed_message"]
    assert len(refused) == len(bad)
    assert {e["build_id"] for e in refused} == {"b1-abc"}
    assert {e["stream"] for e in refused} == {"child->daemon"}
    assert refused[-1]["malformed"] == len(bad)


def test_unknown_command_is_refused() -> None:
    decoder = command_decoder()
    with capture_logs() as logs:
        assert decoder.feed(msgpack.packb({"op": "pause"}) + msgpack.packb("cancel")) == []
    assert decoder.malformed == 2
    assert [e["stream"] for e in logs] == ["daemon->child", "daemon->child"]


def test_undecodable_bytes_are_refused_and_the_decoder_recovers() -> None:
    decoder = child_message_decoder()
    with capture_logs() as logs:
        assert decoder.feed(b"\xc1") == []  # 0xc1: never used in msgpack
    assert decoder.malformed == 1
    assert logs[0]["why"].startswith("undecodable")
    message = ErrorMessage("boom")
    assert decoder.feed(encode(message)) == [message]


def test_message_split_across_reads_decodes() -> None:
    messages = [EventMessage(_event(seq=n)) for n in range(3)]
    stream = b"".join(encode(m) for m in messages)
    decoder = child_message_decoder()
    received: list[ChildMessage] = []
    for i in range(len(stream)):  # one byte per read
        received += decoder.feed(stream[i : i + 1])
    assert received == messages
    assert decoder.malformed == 0


def test_partial_message_waits_for_the_rest() -> None:
    wire = encode(ReportMessage({"outcome": "failed"}, "/s.json"))
    decoder = child_message_decoder()
    assert decoder.feed(wire[:5]) == []
    assert decoder.feed(wire[5:] + wire[:2]) == [ReportMessage({"outcome": "failed"}, "/s.json")]
    assert decoder.malformed == 0
