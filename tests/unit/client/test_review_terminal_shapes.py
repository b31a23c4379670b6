"""A reply of a daemon of another version (a field missing, or of another type)
ends no ``inferctl`` command in a traceback: ``status``, ``health`` and ``build
status`` show it as it came (``cli_format.generic``) with a note on stderr,
``build follow`` says the reply is malformed (exit 1), and ``top`` shows every
section it can, saying which it cannot.  ``top --interval`` NaN or infinite is a
usage error: it polled once and never again (NaN: waiting 0 s a turn, a core
spinning)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import pytest

from inferd_client import cli, cli_build, top
from inferd_client.client import OperatorClient
from inferd_client.errors import MalformedReply
from inferd_client.events import EventSubscriber
from inferd_client.top import TopState
from tests.unit.client.scripted import Script, answering, top_screen

ODD_STATUS = {
    "daemon": {"version": "9.0.0", "pid": 7, "state": "serving", "uptime_s": 3.5},
    "models": [{"model": "detector", "state": "serving", "requests": 4}],
    "thermal": {"available": True, "source": "nvml", "last_reading": {"gpu_temp_c": "hot"}},
    "alerts": None,
}


@pytest.mark.parametrize(
    ("command", "result"),
    [
        ("status", ODD_STATUS),
        ("health", {"state": "serving", "threads": None, "models": {}}),
        ("status", {"daemon": "9.0.0", "models": "detector"}),
    ],
)
def test_a_reply_the_layout_does_not_know_is_shown_as_it_came(
    server: Callable[[Script], str],
    capsys: pytest.CaptureFixture[str],
    command: str,
    result: dict[str, Any],
) -> None:
    endpoint = server(answering(result))
    assert cli.main(["--control-endpoint", endpoint, command]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert "not laid out as this inferctl knows" in err and err.count("\n") == 1
    assert all(f"{key}:" in out for key in result)  # every field, as generic shows it


def test_build_status_with_neither_builds_nor_build_is_shown_as_it_came(
    server: Callable[[Script], str], capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = server(answering({"jobs": []}))
    assert cli.main(["--control-endpoint", endpoint, "build", "status"]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert "jobs:" in out and "shown as it came" in err


def test_build_follow_of_a_build_status_without_its_build_is_a_malformed_reply(
    server: Callable[[Script], str], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    class Joined(EventSubscriber):
        def wait_joined(self, timeout: float, *, keep_health: bool = False) -> None:
            pass  # no daemon publishes here: the status is read at once

    endpoint = server(answering({"builds": []}))
    args = argparse.Namespace(
        build_command="follow", build_id="b1", timeout=1.0, json=False, count=0
    )
    with pytest.raises(MalformedReply, match="has no 'build' map"):
        cli_build.follow(
            args,
            lambda: OperatorClient(endpoint, timeout=5),
            lambda topics: Joined(f"ipc://{tmp_path}/none.sock", topics=topics),
        )


def test_top_shows_what_a_status_of_another_version_allows() -> None:
    state = TopState()
    status = {
        "daemon": {"version": "9.0.0", "pid": 7, "state": "serving", "uptime_s": 5},
        # no "thermal": the header cannot be drawn; a model without counts or responses
        "models": [{"model": "detector", "state": "serving"}, "not a model"],
        "shm": {"enabled": True},
        "builds": [],
    }
    state.on_status(status, [{"build_id": "b1", "state": "running"}, "?"], at=1.0)
    state.on_status(status, [], at=2.0)
    state.on_event("build", {"buildId": "b1", "name": "parse", "step": "two", "numSteps": 2})
    state.on_event("alert", {"ts_ns": None, "level": "ERROR", "code": "c", "message": 42})
    shown = top_screen(state)
    assert "daemon: not shown, the daemon's reply differs (KeyError: 'thermal')" in shown
    assert "shared memory: not shown" in shown
    model_row = next(line for line in shown.splitlines() if line.lstrip().startswith("detector"))
    assert "serving" in model_row
    assert "42" in shown and "c" in shown  # the alert, with no time


@pytest.mark.parametrize("interval", [math.nan, math.inf, 0.0])
def test_top_interval_must_be_finite_and_positive(interval: float) -> None:
    def control() -> OperatorClient:
        raise KeyboardInterrupt  # the view would end here, had it started

    events = EventSubscriber("ipc:///nonexistent/inferd-events.sock")
    with pytest.raises(ValueError, match="--interval must be a finite number"):
        top.run(control, events, endpoint="ipc://x", interval=interval)
    events.close()
