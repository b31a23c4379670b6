"""Text the daemon relays (a model's load error, a build's error, an alert, a
client's ``requested_by``) reaches no terminal as control characters: ``inferctl``
shows every control (C0, DEL, C1, bidi and line separators) escaped, keeps the
rest of Unicode, and ``--json`` stays exact JSON.  A hostile string here is an
OSC 52 clipboard write, an erase of the screen, a carriage return and a forged
line, a C1 CSI and a right-to-left override."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from inferd_client import cli, cli_format
from inferd_client.top import TopState
from tests.unit.client.scripted import Loop, Script, answering, socket_threads, top_screen

HOSTILE = "x\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\r\nforged line\x9b1m\u202eé"


def raw_controls(shown: str) -> list[str]:
    """The characters of ``shown`` a terminal would act on (newlines between lines aside)."""
    return [char for char in shown if not char.isprintable() and char != "\n"]


def status_result() -> dict[str, Any]:
    return {
        "daemon": {"version": "0.1.0", "pid": 7, "state": "serving", "uptime_s": 3.5},
        "models": [
            {
                "model": "det" + HOSTILE,
                "state": "unavailable",
                "runtime": None,
                "requests": 0,
                "responses": {},
                "reason": "cannot load: node " + HOSTILE,
            }
        ],
        "thermal": {"available": False, "last_error": HOSTILE},
        "fdr": {"enabled": False},
        "bus": {},
        "alerts": {},
    }


def test_status_shows_daemon_text_escaped_and_columns_aligned(
    server: Callable[[Script], str], capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = server(answering(status_result()))
    assert cli.main(["--control-endpoint", endpoint, "status"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert raw_controls(out) == []
    assert "det" in out and "\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b[2J\\x0d\\x0aforged line" in out
    assert "\\x9b1m\\u202eé" in out  # printable Unicode (é) kept
    assert not any(line.startswith("forged") for line in out.splitlines())
    header, row = (line for line in out.splitlines() if line.startswith(("MODEL", "det")))
    assert header.index("STATE") == row.index("unavailable")  # the escaped name's width


def test_status_json_is_exact_json_with_no_raw_control(
    server: Callable[[Script], str], capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = server(answering(status_result()))
    assert cli.main(["--control-endpoint", endpoint, "status", "--json"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert raw_controls(out) == []
    assert json.loads(out)["models"][0]["model"] == "det" + HOSTILE


def test_a_daemon_error_message_is_one_escaped_line(
    server: Callable[[Script], str], capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        request = msgpack.unpackb(frames[1])
        error = {"code": "NOT_FOUND", "message": "no model " + HOSTILE}
        reply = {"v": 1, "id": request["id"], "ok": False, "error": error}
        sock.send_multipart([frames[0], msgpack.packb(reply)])

    endpoint = server(refuse)
    code = cli.main(["--control-endpoint", endpoint, "switch", "m", "tensorrt"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_REMOTE_ERROR
    assert raw_controls(err) == [] and err.count("\n") == 1
    assert err.startswith("inferctl: NOT_FOUND: no model x\\x1b]52;")


def test_build_status_escapes_the_builds_model_and_error(
    server: Callable[[Script], str], capsys: pytest.CaptureFixture[str]
) -> None:
    build = {
        "build_id": "b1",
        "model": "m" + HOSTILE,
        "builder": "tensorrt",
        "simulated": False,
        "state": "failed",
        "elapsed_s": 1.5,
        "cancel_source": None,
        "error": "parse failed at node " + HOSTILE,
        "phase_tree": {
            "roots": [
                {
                    "name": HOSTILE,
                    "status": "failed",
                    "completedSteps": 0,
                    "numSteps": 1,
                    "children": [],
                }
            ]
        },
    }
    endpoint = server(answering({"build": build}))
    assert cli.main(["--control-endpoint", endpoint, "build", "status", "b1"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert raw_controls(out) == []
    assert "error: parse failed at node x\\x1b]52;" in out


@pytest.fixture
def events(tmp_path: Path) -> Iterator[Callable[[bytes, dict[str, Any]], str]]:
    """``events(topic, payload)``: the endpoint of a PUB socket that publishes that
    event and a ``health`` event (inferctl joins on it) again and again until the
    test ends."""

    def publishing(topic: bytes, payload: dict[str, Any]) -> Loop:
        def loop(sock: zmq.Socket[Any], stop: threading.Event) -> None:
            while not stop.wait(0.005):  # the publishing pace, not a synchronisation
                sock.send_multipart([b"health", msgpack.packb({"state": "serving"})])
                sock.send_multipart([topic, msgpack.packb(payload)])

        return loop

    with socket_threads(tmp_path, zmq.PUB, "events", join_s=5) as start:
        yield lambda topic, payload: start(publishing(topic, payload))


def test_events_show_an_alerts_message_escaped(
    events: Callable[[bytes, dict[str, Any]], str], capsys: pytest.CaptureFixture[str]
) -> None:
    alert = {"ts_ns": 1, "level": "ERROR", "code": "model_unavailable", "message": HOSTILE}
    endpoint = events(b"alert", alert)
    argv = ["--events-endpoint", endpoint, "events", "--topic", "alert", "--count", "1"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert raw_controls(out) == [] and out.count("\n") == 1
    assert "model_unavailable: x\\x1b]52;c;" in out


def test_build_follow_shows_a_phase_name_escaped(
    events: Callable[[bytes, dict[str, Any]], str], capsys: pytest.CaptureFixture[str]
) -> None:
    event = {"buildId": "b1", "type": "phase_start", "phaseId": "p", "name": HOSTILE, "numSteps": 2}
    endpoint = events(b"build", event)
    argv = ["--events-endpoint", endpoint, "build", "follow", "--count", "1"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert raw_controls(out) == [] and "+ x\\x1b]52;c;" in out


def test_the_layouts_escape_every_value_they_are_given() -> None:
    lines = [
        *cli_format.generic({"requested_by": HOSTILE, HOSTILE: 1, "peers": [{"who": HOSTILE}]}),
        cli_format.event("runtime", {"model": HOSTILE, "state": "serving", "reason": HOSTILE}),
        cli_format.event("custom" + HOSTILE, {"what": HOSTILE}),
    ]
    assert [raw_controls(cli_format.printable(line)) for line in lines] == [[]] * len(lines)
    assert cli_format.printable(cli_format.printable(HOSTILE)) == cli_format.printable(HOSTILE)
    assert cli_format.printable("détecteur 日本 ✓") == "détecteur 日本 ✓"


def test_top_shows_names_and_alerts_escaped_and_never_as_markup() -> None:
    state = TopState()
    model = {
        "model": "[/bold]" + HOSTILE,
        "state": "serving",
        "runtime": "onnx_trt_ep",
        "fallback": False,
        "requests": 1,
        "responses": {"OK": 1},
        "latency_us": {},
        "queue_depth": 0,
        "queue_capacity": 8,
    }
    status = {
        "daemon": {"version": HOSTILE, "pid": 1, "state": "serving", "uptime_s": 1},
        "thermal": {"available": False},
        "models": [model],
    }
    build = {"build_id": "b1", "model": "[link=x]m", "builder": "t", "state": "running"}
    state.on_status(status, [{**build, "elapsed_s": 1.0}], at=1.0)
    state.on_event("build", {"buildId": "b1", "name": HOSTILE, "step": 0, "numSteps": 2})
    state.on_event("alert", {"ts_ns": 0, "level": "ERROR", "code": "c", "message": HOSTILE})
    shown = top_screen(state)
    assert raw_controls(shown) == []
    assert "[/bold]x\\x1b]52;c;" in shown and "[link=x]m" in shown
