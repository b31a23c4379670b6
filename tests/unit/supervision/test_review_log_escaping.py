"""The daemon's own log lines show no terminal control a client or a file put in
them (DESIGN.md 252 and 259 did the command-line tools and the client's free
text; this is the log).  A string request ``id`` (any 1..128 characters), an
error text quoting a file, a TensorRT message naming an ONNX node: on the
console format (``make run``, systemd's stderr) every value is shown through
``inferd_wire.printable``; journald keeps each field's value as it was (data)
and escapes ``MESSAGE``, the human line; JSON escapes by itself."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest
import structlog
import zmq

from inferd.bus.codec import Limits
from inferd.bus.dispatch import Dispatcher
from inferd.config import ModelConfig
from inferd.repeat_limiter import RepeatLimiter
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot
from inferd.supervision import logging as inferd_logging
from inferd.supervision.journal_fields import journal_fields
from inferd.supervision.journal_sender import JournalSender, NativeJournalSender
from inferd.supervision.logging import JournaldRenderer, configure_logging
from inferd_client import cli_format
from inferd_wire import printable as wire_printable
from inferd_wire import protocol
from tests.unit.supervision.conftest import as_dict

pytestmark = pytest.mark.systemd

#: What a client may put in a string request id (1..128 characters, any of them),
#: none with a space or a quote (structlog's console quotes those with ``repr``).
HOSTILE = {
    "csi_clear": "x\x1b[2J\x1b[H",
    "osc52_clipboard": "x\x1b]52;c;cm0gLXJmIH4K\x07",
    "c1_csi": "x\x9b31m",
    "bidi_override": "x\u202eexe.txt",
    "nul_del": "x\x00\x7f",
    "line_separator": "x\u2028y",
    "tag_character": "x\U000e0001",
}


def _configure(fmt: str, sender: JournalSender | None = None) -> None:
    """Logging as the daemon sets it, with a repeat limiter of its own: the
    process-wide one would hold back the same event logged by the next case."""
    configure_logging("info", fmt, sender=sender, limiter=RepeatLimiter())


def _console_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.endswith("\n")
    return err[:-1]


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_console_line_shows_no_control_of_a_value(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _configure("console")
    structlog.get_logger("t").error("inference_failed", model="m", request_id=text)
    line = _console_line(capsys)
    assert line.isprintable(), repr(line)
    assert f"request_id={wire_printable.printable(text)}" in line


def test_a_console_line_escapes_the_event_name_and_a_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _configure("console")
    structlog.get_logger("t").info("odd\x1b[31m", **{"k\x1b[2J": 1})
    line = _console_line(capsys)
    assert line.isprintable(), repr(line)
    assert "odd\\x1b[31m" in line and "k\\x1b[2J=1" in line


def test_a_newline_in_a_console_value_forges_no_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Already so on structlog 26 (it quotes a value with a newline); pinned."""
    forged = "x\n2026-01-01T00:00:00.000000Z [error    ] daemon_stopping"
    _configure("console")
    structlog.get_logger("t").info("request_refused", request_id=forged, crlf="a\r\nb")
    line = _console_line(capsys)
    assert "\n" not in line and line.isprintable(), repr(line)


def test_a_console_traceback_keeps_its_lines_and_shows_no_control(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _configure("console")
    try:
        raise RuntimeError("node x\x1b]52;c;QUFB\x07 failed \x9b2J")
    except RuntimeError:
        structlog.get_logger("t").exception("request_handler_failed", request_id=1)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) > 3  # the traceback is still lines
    assert all(line.isprintable() for line in lines), lines
    [last] = [line for line in lines if line.startswith("RuntimeError: ")]
    assert last.startswith("RuntimeError: node x\\x1b]52;c;QUFB") and last.endswith(" \\x9b2J")


@pytest.fixture
def failing_dispatcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[Dispatcher]:
    slot = ModelSlot(ModelConfig(name="m", path=Path("m.onnx")))
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")

    def admit(*_args: object) -> None:  # a bug in admission
        raise RuntimeError("admission failed")

    monkeypatch.setattr(RequestRouter, "_admit", admit)
    yield Dispatcher(RequestRouter({"m": slot}, scheduler, {}), Limits(1 << 20, 1 << 16, 8), list)
    scheduler.close()


def test_a_string_request_id_reaches_the_console_escaped_and_the_client_as_sent(
    failing_dispatcher: Dispatcher, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon's own path: a handler fails on a request whose id holds an OSC 52
    clipboard write; ``request_handler_failed`` names the id.  The reply still
    echoes it exactly: the id is the client's correlation token (PROTOCOL.md)."""
    request_id = HOSTILE["osc52_clipboard"]
    _configure("console")
    header = {"v": 1, "id": request_id, "op": "infer", "model": "m", "inputs": []}
    frames = [zmq.Frame(b"client"), zmq.Frame(protocol.pack(header))]
    reply = failing_dispatcher.message(frames, True)
    assert reply is not None and reply.header["id"] == request_id
    err = capsys.readouterr().err
    assert "request_handler_failed" in err
    assert all(line.isprintable() for line in err.splitlines()), err
    assert f"request_id={wire_printable.printable(request_id)}" in err


def test_a_clean_console_line_is_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    """A control: a line with nothing to escape is structlog's, character for character."""
    event = {"event": "engine_warm", "model": "det", "reason": "a b", "took_ms": 12.5}
    expected = structlog.dev.ConsoleRenderer(colors=False)(None, "info", {**event, "level": "info"})
    _configure("console")
    structlog.get_logger("t").info(**event)
    assert _console_line(capsys).partition(" ")[2] == expected  # after the timestamp


def test_an_escaped_value_is_shown_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    """Escaping twice changes nothing: a value already escaped is not escaped again."""
    escaped = wire_printable.printable(HOSTILE["c1_csi"])
    _configure("console")
    structlog.get_logger("t").info("e", once=HOSTILE["c1_csi"], twice=escaped)
    line = _console_line(capsys)
    assert f"once={escaped} " in line and line.endswith(f"twice={escaped}")


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
def test_json_lines_escape_every_control_and_keep_the_value(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A control: ``json.dumps`` (ensure_ascii) writes every control as ``\\uXXXX``."""
    _configure("json")
    try:
        raise RuntimeError(text)
    except RuntimeError:
        structlog.get_logger("t").exception("request_handler_failed", request_id=text)
    line = _console_line(capsys)
    assert "\n" not in line and line.isascii() and line.isprintable(), repr(line)
    document = json.loads(line)
    assert document["request_id"] == text
    assert document["exception"].endswith(f"RuntimeError: {text}")


def test_the_journal_keeps_field_values_exact_and_escapes_the_message() -> None:
    request_id = HOSTILE["osc52_clipboard"]
    path = PurePosixPath("/var/lib/inferd/models/x\x1b[2J.onnx")
    fields = journal_fields(
        {"event": "inference_failed", "level": "error", "request_id": request_id, "model": path}
    )
    values = dict(fields)
    assert values["INFERD_REQUEST_ID"] == request_id.encode()  # data: as it was
    assert values["INFERD_MODEL"] == str(path).encode()
    message = values["MESSAGE"].decode()
    assert message.isprintable(), repr(message)
    assert f"request_id={request_id!r}" in message  # quoted, as a value with a space is
    assert "model=/var/lib/inferd/models/x\\x1b[2J.onnx" in message


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
def test_the_journal_message_shows_no_control_of_a_value(text: str) -> None:
    fields = dict(journal_fields({"event": "e", "level": "info", "id": text}))
    message = fields["MESSAGE"].decode()
    assert message.isprintable(), repr(message)
    assert fields["INFERD_ID"] == text.encode()


def test_the_journal_message_escapes_the_event_name_and_a_key() -> None:
    fields = dict(journal_fields({"event": "e\x1b[1m", "level": "info", "k\x07": 1}))
    assert fields["MESSAGE"].decode() == "e\\x1b[1m k\\x07=1"
    assert fields["INFERD_EVENT"] == b"e\x1b[1m"  # data: as it was


def test_the_journal_message_keeps_a_tracebacks_lines_and_escapes_them() -> None:
    entries: list[dict[str, list[str]]] = []
    _configure("journald", sender=lambda f: entries.append(as_dict(list(f))))
    try:
        raise RuntimeError("node x\x1b]52;c;QUFB\x07 failed")
    except RuntimeError:
        structlog.get_logger("t").exception("request_handler_failed", request_id=7)
    assert inferd_logging.flush_journal(5)
    [entry] = entries
    [message] = entry["MESSAGE"]
    lines = message.split("\n")
    assert len(lines) > 3 and all(line.isprintable() for line in lines), lines
    assert lines[-1] == "RuntimeError: node x\\x1b]52;c;QUFB\\x07 failed"


def test_the_journal_fallback_line_on_stderr_is_escaped(tmp_path: Path) -> None:
    out = io.StringIO()
    sender = NativeJournalSender(str(tmp_path / "no-journald.sock"))
    renderer = JournaldRenderer(sender, fallback=out)
    with pytest.raises(structlog.DropEvent):
        renderer(None, "error", {"event": "e", "level": "error", "id": HOSTILE["csi_clear"]})
    assert renderer.writer.flush(5)
    sender.close()
    notice, line = out.getvalue().splitlines()
    assert notice.startswith("inferd: journald unreachable")
    assert line.isprintable() and "id=x\\x1b[2J\\x1b[H" in line, repr(line)


def test_one_escaping_function_and_the_daemons_logging_imports_no_client() -> None:
    assert cli_format.printable is wire_printable.printable
    code = "import sys, inferd.supervision.logging; print('inferd_client' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "False"
