"""Every key that bounds what the daemon can be made to hold has a ceiling: a
config that names more is refused at load (``inferd check-config`` and ``inferd
run`` exit 2 naming the key and its range), and the ceiling itself loads.  Before,
``models.queue_capacity``, ``fdr.queue_capacity``, ``bus.max_frames``,
``bus.max_header_bytes``, ``shm.max_requests_per_connection``, the byte caps of
queues, replies and mapped regions, and ``fdr.segment_max_bytes`` (read whole
at the recorder's start) took any positive integer, 2**62 included."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inferd import config
from inferd.cli.main import main
from inferd.errors import ConfigError
from tests.unit.config.test_config import MINIMAL, load_text

MODEL = "[[models]]\nname = 'demo'\npath = 'models/demo.onnx'\n"
GIB = 1024**3


def model_key(key: str) -> Callable[[int], str]:
    return lambda value: f"{MODEL}{key} = {value}\n"


def section_key(section: str, key: str, extra: str = "") -> Callable[[int], str]:
    return lambda value: f"[{section}]\n{key} = {value}\n{extra}" + MINIMAL


#: (key as the error names it, its ceiling, the config text with a value, where it loads to)
CEILINGS: list[tuple[str, int, Callable[[int], str], Callable[[config.Config], Any]]] = [
    (
        "models['demo'].queue_capacity",
        4096,
        model_key("queue_capacity"),
        lambda c: c.models[0].queue_capacity,
    ),
    (
        "models['demo'].queue_max_bytes",
        1024 * GIB,
        model_key("queue_max_bytes"),
        lambda c: c.models[0].queue_max_bytes,
    ),
    (
        "fdr.queue_capacity",
        65536,
        section_key("fdr", "queue_capacity"),
        lambda c: c.fdr.queue_capacity,
    ),
    (
        "fdr.segment_max_bytes",
        256 * 1024**2,
        section_key("fdr", "segment_max_bytes", f"max_total_bytes = {GIB}\n"),
        lambda c: c.fdr.segment_max_bytes,
    ),
    ("bus.max_frames", 1024, section_key("bus", "max_frames"), lambda c: c.bus.max_frames),
    (
        "bus.max_header_bytes",
        256 * 1024,
        section_key("bus", "max_header_bytes"),
        lambda c: c.bus.max_header_bytes,
    ),
    (
        "bus.max_reply_bytes_total",
        1024 * GIB,
        section_key("bus", "max_reply_bytes_total"),
        lambda c: c.bus.max_reply_bytes_total,
    ),
    (
        "shm.max_requests_per_connection",
        65536,
        section_key("shm", "max_requests_per_connection"),
        lambda c: c.shm.max_requests_per_connection,
    ),
    (
        "shm.max_bytes_total",
        1024 * GIB,
        section_key("shm", "max_bytes_total"),
        lambda c: c.shm.max_bytes_total,
    ),
]
IDS = [key for key, *_ in CEILINGS]


@pytest.mark.parametrize(("key", "ceiling", "text", "loaded"), CEILINGS, ids=IDS)
def test_the_ceiling_loads(
    tmp_path: Path,
    key: str,
    ceiling: int,
    text: Callable[[int], str],
    loaded: Callable[[config.Config], Any],
) -> None:
    assert loaded(load_text(tmp_path, text(ceiling))) == ceiling


@pytest.mark.parametrize(("key", "ceiling", "text", "loaded"), CEILINGS, ids=IDS)
@pytest.mark.parametrize("over", [1, 2**62])
def test_a_value_over_the_ceiling_is_refused_at_load_naming_the_key_and_its_range(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    key: str,
    ceiling: int,
    text: Callable[[int], str],
    loaded: Callable[[config.Config], Any],
    over: int,
) -> None:
    value = ceiling + 1 if over == 1 else over
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "demo.onnx").write_bytes(b"")  # check-config looks for it
    path = tmp_path / "inferd.toml"
    path.write_text(text(value))
    least = 1024 if key == "fdr.segment_max_bytes" else 1  # FDR_SEGMENT_MIN_BYTES
    for command in (["check-config", str(path)], ["run", "--config", str(path)]):
        assert main(command) == 2
        assert f"{key} must be {least}..{ceiling}, got {value}" in capsys.readouterr().err


def test_the_lower_bounds_still_say_positive(tmp_path: Path) -> None:
    """Unchanged: 0 and below are refused as before, in the same words."""
    for text, key in (
        (model_key("queue_capacity")(0), "models['demo'].queue_capacity must be positive"),
        (section_key("fdr", "queue_capacity")(0), "fdr.queue_capacity must be positive"),
        (section_key("bus", "max_frames")(-1), "bus.max_frames must be positive"),
        (
            section_key("shm", "max_requests_per_connection")(0),
            "shm.max_requests_per_connection must be positive",
        ),
    ):
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_text(tmp_path, text)
