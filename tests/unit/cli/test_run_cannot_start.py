"""``inferd run`` when the daemon cannot start: one path for every failure, the
constructor's included, that says why on stderr and to systemd (``STATUS=``, with
``ERRNO=`` when the error carries an OS error number, a ``zmq.ZMQError``'s too),
with a bug's type, and exits 2 for what a restart would meet again (a config
error, a limit, a directory another user may write), 1 otherwise.  ``main`` runs
in process, with a stand-in ``Daemon`` whose construction or start raises."""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

import inferd.daemon
from inferd.cli.main import main
from inferd.errors import UncheckedDirectoryError, UnsafeDirectoryError
from tests.conftest import REPO, render_config
from tests.unit.cli.conftest import sent


class Refused:
    """Stands in for ``Daemon``: ``construct`` or ``start`` raises ``error``."""

    def __init__(self, error: BaseException, *, at: str) -> None:
        self.error, self.at = error, at

    def __call__(self, config: object) -> Refused:
        if self.at == "construct":
            raise self.error
        return self

    def start(self, supervision: object = None) -> None:
        raise self.error


def run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException, at: str
) -> tuple[int, list[MutableMapping[str, Any]]]:
    config = tmp_path / "inferd.toml"
    config.write_text(render_config(tmp_path, [{"name": "m", "path": str(tmp_path / "m.onnx")}]))
    monkeypatch.setattr(inferd.daemon, "Daemon", Refused(error, at=at))
    with capture_logs() as logs:
        code = main(["run", "--config", str(config)])
    return code, logs


def test_a_bug_at_start_is_said_with_its_type(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    notify: socket.socket,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``'x'`` alone says nothing: the line says ``KeyError: 'x'``, as
    ``daemon_start_failed`` does (the same rule, ``startup.EXPECTED``)."""
    code, _ = run(tmp_path, monkeypatch, KeyError("x"), at="start")
    assert code == 1
    assert "inferd: cannot start: KeyError: 'x'\n" in capsys.readouterr().err
    assert sent(notify) == ["STATUS=cannot start: KeyError: 'x'"]


def test_an_expected_error_keeps_its_message_alone(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    notify: socket.socket,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A taken port (a ``zmq.ZMQError``, no ``OSError``) says its message in full, and
    systemd gets its ``EADDRINUSE`` (``systemctl status``: ``Error: 98``)."""
    code, _ = run(tmp_path, monkeypatch, zmq.ZMQError(errno.EADDRINUSE), at="start")
    assert code == 1
    assert "inferd: cannot start: Address already in use\n" in capsys.readouterr().err
    assert sent(notify) == [
        "STATUS=cannot start: Address already in use",
        f"ERRNO={errno.EADDRINUSE}",
    ]


def test_libzmqs_own_error_numbers_are_not_sent_as_errno(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, notify: socket.socket
) -> None:
    """``ETERM`` is 156384765, no errno: systemd would say "Unknown error"."""
    code, _ = run(tmp_path, monkeypatch, zmq.ZMQError(zmq.ETERM), at="start")
    assert code == 1
    lines = sent(notify)
    assert lines[0].startswith("STATUS=cannot start: ") and len(lines) == 1


def test_a_constructor_that_raises_takes_the_failed_start_path(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    notify: socket.socket,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``EMFILE`` making the ZeroMQ context: no raw traceback, but the line, the
    ``STATUS=`` and ``ERRNO=``, the journal's ``daemon_start_failed``, exit 1."""
    error = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    code, logs = run(tmp_path, monkeypatch, error, at="construct")
    assert code == 1
    said = "cannot start: [Errno 24] Too many open files"
    assert f"inferd: {said}\n" in capsys.readouterr().err
    assert sent(notify) == [f"STATUS={said}", f"ERRNO={errno.EMFILE}"]
    failed = [entry for entry in logs if entry["event"] == "daemon_start_failed"]
    assert [(entry["step"], entry["error"]) for entry in failed] == [
        ("daemon.init", f"OSError: {error}")
    ]
    assert not failed[0]["exc_info"]  # the host's doing: no traceback


def test_a_bug_in_the_constructor_keeps_its_traceback_in_the_journal(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    notify: socket.socket,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, logs = run(tmp_path, monkeypatch, KeyError("x"), at="construct")
    assert code == 1
    assert "inferd: cannot start: KeyError: 'x'\n" in capsys.readouterr().err
    assert sent(notify) == ["STATUS=cannot start: KeyError: 'x'"]
    failed = [entry for entry in logs if entry["event"] == "daemon_start_failed"]
    assert [(entry["step"], entry["exc_info"]) for entry in failed] == [("daemon.init", True)]


def test_an_unsafe_directory_at_start_is_not_restarted(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    notify: socket.socket,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 2 (``RestartPreventExitStatus=2``): the directory is the same at the
    next start; the operator fixes it and starts the unit."""
    error = UnsafeDirectoryError("the directory of shm.socket /x is writable by others")
    code, _ = run(tmp_path, monkeypatch, error, at="start")
    assert code == 2
    assert f"inferd: cannot start: {error}\n" in capsys.readouterr().err
    assert sent(notify) == [f"STATUS=cannot start: {error}"]


def test_a_directory_that_could_not_be_checked_is_restarted_with_its_errno(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    notify: socket.socket,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Out of descriptors while checking a directory is no fault of the directory:
    exit 1 (systemd restarts it) and ``ERRNO=`` names the limit met."""
    error = UncheckedDirectoryError(
        "daemon.runtime_dir /run/inferd could not be checked (EMFILE: Too many open files)",
        errno_code=errno.EMFILE,
    )
    code, _ = run(tmp_path, monkeypatch, error, at="start")
    assert code == 1
    assert f"inferd: cannot start: {error}\n" in capsys.readouterr().err
    assert sent(notify) == [f"STATUS=cannot start: {error}", f"ERRNO={errno.EMFILE}"]


def test_an_unsafe_state_dir_tells_systemd_and_is_not_restarted(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    notify: socket.socket,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command line's own check of ``daemon.state_dir``, before any daemon."""
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    code, logs = run(tmp_path, monkeypatch, AssertionError("never constructed"), at="construct")
    assert code == 2
    said = f"cannot start: daemon.state_dir {state} is writable by its group and others"
    assert f"inferd: {said}" in capsys.readouterr().err
    [status] = sent(notify)
    assert status.startswith(f"STATUS={said}")
    failed = [entry for entry in logs if entry["event"] == "daemon_start_failed"]
    assert [entry["step"] for entry in failed] == ["state_dir"]


def test_a_demo_model_that_cannot_be_written_takes_the_failed_start_path(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    notify: socket.socket,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``inferd run`` without ``--config`` writes the bundled demo model first: a full
    disk there escaped ``main`` with a traceback and no ``STATUS=`` (a review of 289)."""
    import inferd.demo_model

    monkeypatch.setenv("INFERD_STATE_DIR", str(tmp_path / "state"))

    def full_disk(path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(inferd.demo_model, "write_demo_model", full_disk)
    monkeypatch.setattr(inferd.daemon, "Daemon", Refused(AssertionError("never"), at="construct"))
    with capture_logs() as logs:
        code = main(["run"])
    assert code == 1  # a disk may be freed: restarted
    assert "inferd: cannot start: [Errno 28] No space left on device" in capsys.readouterr().err
    [status, errno_line] = sent(notify)
    assert status.startswith("STATUS=cannot start: [Errno 28]") and errno_line == "ERRNO=28"
    failed = [entry for entry in logs if entry["event"] == "daemon_start_failed"]
    assert [entry["step"] for entry in failed] == ["state_dir"]


def test_a_fifo_planted_as_the_lock_file_is_a_named_start_refused_with_exit_2(
    tmp_path: Path, notify: socket.socket, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the real ``Daemon``, whose first start step takes the lock (DESIGN.md 291).
    Before: ``cannot start: [Errno 22] Invalid argument`` (the FIFO's truncation),
    naming no file, exit 1, and systemd restarted it into the same FIFO."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    os.mkfifo(run_dir / "inferd.lock")
    config = tmp_path / "inferd.toml"
    config.write_text(render_config(tmp_path, [{"name": "m", "path": str(tmp_path / "m.onnx")}]))
    with capture_logs() as logs:
        code = main(["run", "--config", str(config)])
    assert code == 2
    said = f"cannot start: {run_dir / 'inferd.lock'} is a FIFO, not a regular file: "
    assert f"inferd: {said}" in capsys.readouterr().err
    [status] = [line for line in sent(notify) if line]  # no ERRNO=: no OS error
    assert status.startswith(f"STATUS={said}")
    failed = [entry for entry in logs if entry["event"] == "daemon_start_failed"]
    assert [(entry["step"], entry["exc_info"]) for entry in failed] == [("instance_lock", False)]
    assert failed[0]["error"].startswith("UnsafeLockFileError: ")


def catalog_entry(event: str) -> str:
    """The text of ``event``'s entry in the journal's message catalog."""
    text = (REPO / "systemd" / "inferd.catalog").read_text()
    entry = text.split(f"\n# {event}\n", 1)[1]
    return " ".join(entry.split("\n# ", 1)[0].split())


def test_the_texts_name_every_exit_status_a_start_or_stop_may_end_with() -> None:
    """What the journal's catalog and the FDR's schema say a process does next: a
    stop after the engine worker died exits 1 (not only 0), a start that failed
    exits 2 for a directory as for a config error (not only 1)."""
    stopped = catalog_entry("daemon_stopped")
    assert "exits: 0 after SIGTERM or SIGINT; 1 when" in stopped
    assert "engine_worker_died" in stopped
    start_failed = catalog_entry("daemon_start_failed")
    assert "exits: 2 for a config error or a directory of its own that another user" in start_failed
    schema = json.loads((REPO / "schemas" / "fdr" / "daemon_lifecycle.json").read_text())
    event = schema["properties"]["event"]["description"]
    assert "exits 1 next" not in event
    assert "2 for a config error" in event and "1 otherwise" in event
