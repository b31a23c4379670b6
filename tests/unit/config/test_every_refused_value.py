"""``inferd check-config`` (and ``inferd run``'s start-up error) lists every value
the sections' rules refuse at once: a section used to stop at its first refused
value (``__post_init__`` raised there), so a config with three mistakes in
``[bus]`` took three runs to fix (``inferd.config.refusals``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.cli.main import main
from inferd.config import BusConfig, ShmConfig, from_mapping
from inferd.config.checks import positive
from inferd.errors import ConfigError

#: Three refused values in ``[bus]`` (one of them a rule between two keys) and
#: two in ``[shm]``, each message word for word as when it was the first.
MISTAKES = {
    "bus": {
        "max_frames": 0,
        "busy_poll_us": -1,
        "heartbeat_interval_ms": 9000,
        "heartbeat_timeout_ms": 5000,
    },
    "shm": {"max_connections": 0, "max_bytes_per_uid": 0},
}
MESSAGES = [
    "bus.max_frames must be positive, got 0",
    "bus.busy_poll_us must be 0..1000, got -1",
    "bus.heartbeat_timeout_ms (5000) must be at least bus.heartbeat_interval_ms (9000)",
    "shm.max_connections must be positive, got 0",
    "shm.max_bytes_per_uid must be positive, got 0",
]


def _toml(tables: dict[str, dict[str, object]], tmp_path: Path) -> str:
    lines = [f"[daemon]\nstate_dir = '{tmp_path}'\nruntime_dir = '{tmp_path}'"]
    for table, values in tables.items():
        lines += [f"[{table}]", *(f"{key} = {value}" for key, value in values.items())]
    return "\n".join([*lines, "[[models]]\nname = 'm'\npath = 'm.onnx'\n"])


def test_check_config_and_run_list_every_refused_value_of_every_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(_toml(MISTAKES, tmp_path))
    for command in (["check-config", str(path)], ["run", "--config", str(path)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        listed = [line.removeprefix("  - ") for line in err.splitlines()[1:]]
        assert listed == MESSAGES, err
        assert "5 errors:" in err.splitlines()[0]


def test_a_value_refused_once_is_not_judged_again(tmp_path: Path) -> None:
    """A negative count is "must be positive", not also out of its range, and a rule
    between two values is left out when one of them was refused on its own."""
    data = {
        "bus": {"max_reply_bytes_total": 0, "heartbeat_interval_ms": 9_000_000},
        "shm": {"max_connections": -1},
    }
    with pytest.raises(ConfigError) as refused:
        from_mapping(
            {**data, "models": [{"name": "m", "path": "m.onnx"}]}, source="t", base_dir=tmp_path
        )
    assert str(refused.value).splitlines()[1:] == [
        "  - bus.max_reply_bytes_total must be positive, got 0",
        "  - bus.heartbeat_interval_ms must be 0..3600000 ms, got 9000000",
        "  - shm.max_connections must be positive, got -1",
    ]


def test_the_values_the_loader_refuses_before_a_section_are_listed_with_its_rules(
    tmp_path: Path,
) -> None:
    data = {
        "runtime": {"engine_dir": " ", "device_id": 999},
        "models": [{"name": "m", "path": "m.onnx", "precision": "fp64", "queue_capacity": 0}],
    }
    with pytest.raises(ConfigError) as refused:
        from_mapping(data, source="t", base_dir=tmp_path)
    assert str(refused.value).splitlines()[1:] == [
        "  - runtime.engine_dir must name a directory, got an empty string",
        "  - runtime.device_id must be 0..255, got 999",
        "  - models['m'].precision: 'fp64' is not one of ['fp32', 'fp16', 'int8', 'mixed']",
        "  - models['m'].queue_capacity must be positive, got 0",
    ]


def test_a_section_made_in_code_raises_every_refusal_and_one_as_it_always_read(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as one:
        ShmConfig(socket=tmp_path / "shm.sock", max_connections=0)
    assert str(one.value) == "shm.max_connections must be positive, got 0"
    with pytest.raises(ConfigError) as two:
        ShmConfig(socket=tmp_path / "shm.sock", max_connections=0, max_connections_per_uid=0)
    assert str(two.value) == (
        "2 errors:\n  - shm.max_connections must be positive, got 0\n"
        "  - shm.max_connections_per_uid must be positive, got 0"
    )
    endpoints = [f"ipc://{tmp_path}/{name}.sock" for name in ("i", "c", "e")]
    assert BusConfig(*endpoints).max_frames == 64  # nothing refused, nothing raised
    with pytest.raises(ConfigError) as alone:
        positive("x", 0)  # a check on its own raises at once
    assert str(alone.value) == "x must be positive, got 0"
