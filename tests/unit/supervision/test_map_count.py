"""The daemon refuses to start when ``vm.max_map_count`` cannot hold a mapping per
shm region its bounds let clients register, what it maps already and a reserve
(``supervision/map_count.py``): past the sysctl every ``mmap`` fails, its own
(threads, malloc, CUDA) as well as the regions'.  The sysctl and the process's
count are given as arguments here; the real ``/proc`` is only read."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd.config import ShmConfig
from inferd.errors import MapCountLimitError
from inferd.supervision import map_count
from inferd.supervision.map_count import (
    RESERVED_MAPPINGS,
    check_map_count,
    mappings_needed,
    shm_mappings,
)
from tests.conftest import render_config
from tests.unit.supervision.test_open_files import run_notified

SOCKET = Path("/run/inferd/shm.sock")
#: The default sysctl, and what a daemon here maps when it checks (measured: 331).
DEFAULT_MAX_MAP_COUNT = 65530
MAPPED = 331


def shm(**bounds: int | bool) -> ShmConfig:
    return ShmConfig(socket=SOCKET, **bounds)  # type: ignore[arg-type]


def test_the_shm_socket_needs_a_mapping_per_region_and_the_one_being_registered() -> None:
    assert shm_mappings(shm()) == 16 * 16 + 1  # the defaults: 257
    assert shm_mappings(shm(max_connections=64, max_regions_per_connection=1024)) == 65537
    assert shm_mappings(shm(enabled=False)) == 0
    assert mappings_needed(shm()) == 257 + RESERVED_MAPPINGS


def test_the_defaults_fit_the_default_sysctl_with_room_to_spare() -> None:
    with capture_logs() as events:
        left = check_map_count(shm(), DEFAULT_MAX_MAP_COUNT, MAPPED)
    assert left == DEFAULT_MAX_MAP_COUNT - MAPPED - 257 - RESERVED_MAPPINGS  # 48,558
    assert [(e["event"], e["log_level"], e["needed"]) for e in events] == [
        ("map_count", "info", 257 + RESERVED_MAPPINGS)
    ]


def test_regions_past_the_sysctl_refuse_to_start_naming_it_and_the_keys() -> None:
    """64 connections of 1,024 regions (each bound within its ceiling): 65,537
    mappings, more than the whole default sysctl."""
    bounds = shm(max_connections=64, max_regions_per_connection=1024)
    with capture_logs() as events, pytest.raises(MapCountLimitError) as refused:
        check_map_count(bounds, DEFAULT_MAX_MAP_COUNT, MAPPED)
    needed = MAPPED + 65537 + RESERVED_MAPPINGS
    assert (refused.value.limit, refused.value.needed) == (DEFAULT_MAX_MAP_COUNT, needed)
    assert refused.value.errno_code == errno.ENOMEM
    message = str(refused.value)
    assert f"(vm.max_map_count) is 65530, below the {needed} " in message
    assert "shm.max_connections 64 x shm.max_regions_per_connection 1024" in message
    assert f"{MAPPED} the daemon maps at start" in message
    assert "sysctl" in message and "/etc/sysctl.d/" in message
    [event] = events
    assert (event["event"], event["log_level"]) == ("map_count_low", "error")
    assert (event["limit"], event["mapped"]) == (DEFAULT_MAX_MAP_COUNT, MAPPED)


def test_what_the_process_maps_already_counts() -> None:
    """32 connections of 1,024 regions and the reserve (49,153 mappings) fit the
    default sysctl while the process maps at most 16,377 itself, and no more."""
    bounds = shm(max_connections=32, max_regions_per_connection=1024)
    exactly = DEFAULT_MAX_MAP_COUNT - mappings_needed(bounds)  # mapped: the most that fits
    assert exactly == 16377
    assert check_map_count(bounds, DEFAULT_MAX_MAP_COUNT, MAPPED) == exactly - MAPPED
    assert check_map_count(bounds, DEFAULT_MAX_MAP_COUNT, exactly) == 0
    with pytest.raises(MapCountLimitError):
        check_map_count(bounds, DEFAULT_MAX_MAP_COUNT, exactly + 1)


def test_without_shm_a_lowered_sysctl_is_said_not_refused() -> None:
    """No client can make a daemon without shm map more: nothing to change in its
    config, so it starts, and the log says what to raise."""
    with capture_logs() as events:
        left = check_map_count(shm(enabled=False), RESERVED_MAPPINGS, MAPPED)
    assert left == -MAPPED
    [event] = events
    assert (event["event"], event["log_level"]) == ("map_count_low", "warning")
    assert "shm." not in event["hint"] and "vm.max_map_count" in event["hint"]


def test_without_proc_the_daemon_starts_unchecked_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(map_count, "MAX_MAP_COUNT", tmp_path / "max_map_count")  # absent
    with capture_logs() as events:
        assert check_map_count(shm()) is None
    assert [e["event"] for e in events] == ["map_count_unknown"]


def test_the_real_proc_is_read() -> None:
    limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    if limit < mappings_needed(shm()) + 5000:
        pytest.skip(f"vm.max_map_count is {limit} here")
    with capture_logs() as events:
        left = check_map_count(shm())
    [event] = events
    assert event["limit"] == limit and 0 < event["mapped"] < limit
    assert left == limit - event["mapped"] - mappings_needed(shm())


def test_inferd_run_past_the_sysctl_exits_2_and_tells_systemd_why(tmp_path: Path) -> None:
    """Shm bounds past this machine's real ``vm.max_map_count`` (each within its
    ceiling): ``inferd run`` refuses before binding anything, exit 2, on stderr and
    in ``STATUS=``/``ERRNO=ENOMEM`` to systemd."""
    limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    connections = limit // 1024 + 1
    if connections > 16384:
        pytest.skip(f"vm.max_map_count is {limit}: no config within the ceilings exceeds it")
    config = tmp_path / "inferd.toml"
    shm_section = {
        "socket": str(tmp_path / "run" / "shm.sock"),
        "max_connections": connections,
        "max_regions_per_connection": 1024,
    }
    models = [{"name": "m", "path": str(tmp_path / "m.onnx")}]
    config.write_text(render_config(tmp_path, models, shm=shm_section))
    done, sent = run_notified(tmp_path, ["-m", "inferd.cli", "run", "--config", str(config)])
    assert done.returncode == 2, done.stderr
    refusal = f"(vm.max_map_count) is {limit}, below the"
    assert f"inferd: cannot start: the kernel's limit on a process's memory mappings {refusal}" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr
    assert "map_count_low" in done.stdout + done.stderr  # the log event, kept
    assert f"ERRNO={errno.ENOMEM}" in sent
    assert any(line.startswith("STATUS=cannot start: the kernel's limit") for line in sent)
    assert not (tmp_path / "run" / "infer.sock").exists()  # nothing bound


def test_check_config_says_how_many_mappings_the_config_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from inferd.cli.main import main

    (tmp_path / "m.onnx").write_bytes(b"")
    config = tmp_path / "inferd.toml"
    models = [{"name": "m", "path": str(tmp_path / "m.onnx")}]
    config.write_text(render_config(tmp_path, models, shm={"max_regions_per_connection": 100}))
    assert main(["check-config", str(config)]) == 0
    needed = 16 * 100 + 1 + RESERVED_MAPPINGS
    assert f"inferd: note: {config} needs {needed} memory mappings" in capsys.readouterr().err
