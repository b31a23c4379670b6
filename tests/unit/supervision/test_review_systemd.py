"""Review of the systemd integration: what a child inherits, what reaches systemd in
``STATUS=``, what the stop asks for beyond its budget, and the units' OOM policy.

Each test failed on the code before its fix (DESIGN draft in the report)."""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest

from inferd.config.sections import DaemonConfig
from inferd.engine_build import child_process
from inferd.stop_budget import stop_bounds
from inferd.supervision.journal_writer import EXIT_FLUSH_S
from inferd.supervision.notify import STOP_EXIT_MARGIN_S, Notifier
from tests.conftest import HANG_S, REPO
from tests.unit.engine_build.conftest import simulated_spec

UNITS = ("inferd.service", "inferd@.service")


def _received(sock: socket.socket) -> bytes:
    return sock.recv(65536)


def _as_systemd_takes_it(datagram: bytes) -> dict[str, str]:
    """What systemd's ``notify_recv`` accepts: no NUL before the last byte (a
    datagram with one is ignored whole), valid UTF-8, one assignment a line."""
    assert b"\0" not in datagram[:-1], f"systemd ignores this datagram: {datagram!r}"
    text = datagram.decode("utf-8")
    return dict(line.split("=", 1) for line in text.split("\n"))


# -- a build child cannot speak to systemd for the daemon --------------------------


def test_a_build_child_inherits_no_notify_socket_nor_watchdog(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd gives the main process $NOTIFY_SOCKET, $WATCHDOG_USEC, $WATCHDOG_PID;
    a build child (a real one, read from /proc) must start without them, the rest of
    the environment kept."""
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    monkeypatch.setenv("INFERD_REVIEW_KEPT", "yes")
    # Still building when its environment is read.
    spec = simulated_spec(tmp_path, demo_model, step_s=30)
    process = child_process.spawn(spec)  # returns once the child exec'd
    try:
        raw = Path(f"/proc/{process.pid}/environ").read_bytes()
        # Empty once it exited (a zombie has no environment left to read).
        assert raw, f"the build child ended at once: exit {process.wait(timeout=HANG_S)}"
    finally:
        child_process.reap(process)
        child_process.close_pipes(process)
    names = {entry.split(b"=", 1)[0].decode() for entry in raw.split(b"\0") if entry}
    assert "INFERD_REVIEW_KEPT" in names and "PYTHONUNBUFFERED" in names
    assert not names & {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"}


# -- STATUS= is text systemd takes, with what rides along ---------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> tuple[socket.socket, Notifier]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(2)
    return sock, Notifier(path)


def test_ready_is_not_lost_to_a_nul_in_the_status_text(
    notify_socket: tuple[socket.socket, Notifier],
) -> None:
    """``READY=1`` rides with ``STATUS=``: a NUL in the text (an exception's message)
    made systemd ignore the whole datagram, readiness included."""
    sock, notifier = notify_socket
    assert notifier.ready("degraded: det=failed | load error: bad node 'a\x00b'")
    fields = _as_systemd_takes_it(_received(sock))
    assert fields["READY"] == "1"
    assert fields["STATUS"] == "degraded: det=failed | load error: bad node 'a\\x00b'"


def test_status_text_writes_no_terminal_control(
    notify_socket: tuple[socket.socket, Notifier],
) -> None:
    """``systemctl status`` prints the text as it is: an escape sequence or a bidi
    override from a runtime's error message is shown escaped (DESIGN 252/264)."""
    sock, notifier = notify_socket
    assert notifier.status("failed: the engine worker stopped on X: \x1b]52;c;AAAA\x07 \u202eevil")
    status = _as_systemd_takes_it(_received(sock))["STATUS"]
    assert status.isprintable()
    assert status == "failed: the engine worker stopped on X: \\x1b]52;c;AAAA\\x07 \\u202eevil"


def test_a_failure_naming_an_undecodable_path_still_reaches_systemd(
    notify_socket: tuple[socket.socket, Notifier],
) -> None:
    """A config path with a byte that is not UTF-8 arrives as a lone surrogate: the
    datagram could not be encoded, so neither ``STATUS=`` nor ``ERRNO=`` was sent."""
    sock, notifier = notify_socket
    assert notifier.failed("invalid config /etc/inferd/\udcff.toml: unknown key", errno=22)
    fields = _as_systemd_takes_it(_received(sock))
    assert fields == {
        "STATUS": "invalid config /etc/inferd/\\udcff.toml: unknown key",
        "ERRNO": "22",
    }
    assert notifier.failures == 0


# -- the stop asks systemd for its budget and the exit after it --------------------


def _extend_s(datagram: bytes) -> float:
    return int(_as_systemd_takes_it(datagram)["EXTEND_TIMEOUT_USEC"]) / 1e6


def _unit_setting(unit: str, key: str) -> list[str]:
    return [
        line.split("=", 1)[1]
        for line in (REPO / "systemd" / unit).read_text().splitlines()
        if line.startswith(f"{key}=")
    ]


def test_a_stop_longer_than_the_units_timeout_keeps_its_exit_margin(
    notify_socket: tuple[socket.socket, Notifier],
) -> None:
    """The budget ends with the FDR's flush; the process then still exits (the
    journal's queue flushed for up to EXIT_FLUSH_S).  ``TimeoutStopSec=`` gives the
    default budget 5 s for that; a configured budget beyond it was asked for
    exactly, so systemd's SIGKILL came when the budget ran out."""
    sock, notifier = notify_socket
    defaults = DaemonConfig(state_dir=Path("/var/lib/inferd"), runtime_dir=Path("/run/inferd"))
    longer = replace(defaults, shutdown_drain_ms=60_000)
    for config in (defaults, longer):
        budget_s = sum(stop_bounds(config).values())  # Daemon.stop_budget_s
        assert notifier.stopping("stopping", extend_s=budget_s)
        asked_s = _extend_s(_received(sock))
        assert asked_s >= budget_s + EXIT_FLUSH_S + 1.0, (config.shutdown_drain_ms, asked_s)
    # With the defaults, the daemon and the units ask for the same time.
    default_budget_s = sum(stop_bounds(defaults).values())
    for unit in UNITS:
        [timeout_stop] = _unit_setting(unit, "TimeoutStopSec")
        assert float(timeout_stop) == default_budget_s + STOP_EXIT_MARGIN_S, unit


# -- the units: a process killed by the OOM killer does not stop the daemon ---------


@pytest.mark.parametrize("unit", UNITS)
def test_an_oom_killed_build_child_does_not_stop_the_unit(unit: str) -> None:
    """systemd's DefaultOOMPolicy=stop stops the whole unit when the kernel's OOM
    killer takes any of its processes: a TensorRT build child (its largest
    allocation, which the daemon handles: engine_build/child_exit.py) stopped
    perception and restarted every model."""
    assert _unit_setting(unit, "OOMPolicy") == ["continue"]
    child_exit = (REPO / "daemon" / "inferd" / "engine_build" / "child_exit.py").read_text()
    assert "OOM killer" in child_exit  # the daemon's side of it, documented there
