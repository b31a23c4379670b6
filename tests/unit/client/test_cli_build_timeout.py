"""``inferctl build start --timeout S`` sends ``build.start``'s ``timeout_s`` (the
build's deadline), apart from ``inferctl --timeout`` (how long to wait for the
reply), and ``--stall-after S`` its ``stall_after_s``; one the daemon could only
refuse is a usage error before any socket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq

from inferd_client.cli import EXIT_OK, EXIT_USAGE, main
from tests.unit.client.scripted import Script, answer_ok


def test_build_start_timeout_is_the_builds_deadline_not_the_replys_wait(
    server: Callable[[Script], str], capsys: pytest.CaptureFixture[str]
) -> None:
    headers: list[dict[str, Any]] = []

    def recording(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        headers.append(msgpack.unpackb(frames[1]))
        answer_ok(sock, frames)

    endpoint = server(recording)
    common = ["--json", "--timeout", "5", "--control-endpoint", endpoint, "build", "start", "m"]
    assert main([*common, "--timeout", "90.5"]) == EXIT_OK
    assert main(common) == EXIT_OK
    assert main([*common, "--stall-after", "30"]) == EXIT_OK
    assert main([*common, "--stall-after", "0"]) == EXIT_OK
    assert [header.get("timeout_s") for header in headers] == [90.5, None, None, None]
    assert [header.get("stall_after_s") for header in headers] == [None, None, 30.0, 0.0]
    assert headers[0]["op"] == "build.start" and headers[0]["model"] == "m"
    capsys.readouterr()


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_a_build_timeout_the_daemon_would_refuse_is_a_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--json", "build", "start", "m", "--timeout", value]
    assert main(argv) == EXIT_USAGE  # before any socket: none is configured here
    assert "build start --timeout must be a finite number of seconds" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_stall_period_the_daemon_would_refuse_is_a_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--json", "build", "start", "m", "--stall-after", value]
    assert main(argv) == EXIT_USAGE  # before any socket: none is configured here
    assert "build start --stall-after must be 0 (no stall watchdog)" in capsys.readouterr().out
