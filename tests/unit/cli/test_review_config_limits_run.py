"""``inferd run`` with a config it refuses: the file and the key, as ``inferd
check-config`` says them, on stderr (the journal under systemd) and in ``STATUS=``
(DESIGN.md 250 left "invalid config" without the file's path)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from inferd.cli.main import main


def test_inferd_run_names_the_file_and_the_key_on_stderr_and_to_systemd(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "inferd.toml"
    # A value refused before this change too: no version of the code starts a daemon here
    config.write_text('[alerts]\nrate_limit_s = -1\n[[models]]\nname = "demo"\npath = "m.onnx"\n')
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    try:
        assert main(["run", "--config", str(config)]) == 2
        notify.setblocking(False)  # sent before main() returned
        try:
            sent = notify.recv(65536).decode().split("\n")
        except BlockingIOError:  # nothing was sent
            sent = []
    finally:
        notify.close()
    said = f"invalid config {config}: alerts.rate_limit_s must be 1.0..3600.0 s, got -1.0"
    assert f"inferd: {said}" in capsys.readouterr().err
    assert f"STATUS={said}" in sent


def test_every_mistake_is_said_under_the_files_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "inferd.toml"
    config.write_text(
        "[daemon]\nhealth_interval_s = 0\n"  # refused before too: never a daemon started
        "[thermal]\nhysteresis_c = 1e308\n[builds]\nstart_refill_s = 1e-9\n"
        '[[models]]\nname = "dé"\npath = "m.onnx"\n',
        encoding="utf-8",
    )
    assert main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    first, *listed = err.splitlines()
    assert first == f"inferd: invalid config {config}: 4 errors:"
    assert [line.split(" must ")[0] for line in listed] == [
        "  - daemon.health_interval_s",
        "  - thermal.hysteresis_c",
        "  - builds.start_refill_s",
        "  - models['dé'].name",
    ]
