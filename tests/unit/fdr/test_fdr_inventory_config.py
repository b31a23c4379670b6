"""``fdr.max_total_bytes / fdr.segment_max_bytes``, the segments the size cap keeps,
is at most ``MAX_FDR_SEGMENTS`` (131,072): 1 KiB segments under the default 256 MiB
(262,144 files, each ``lstat``-ed at every start) loaded before."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.cli.main import main
from inferd.config import FdrConfig
from inferd.config.ceilings import MAX_DISK_BYTES, MAX_FDR_SEGMENTS
from inferd.errors import ConfigError
from tests.unit.config.test_config import MINIMAL, load_text

MIB = 1024**2


def fdr(segment_max_bytes: int, max_total_bytes: int | None = None) -> str:
    total = "" if max_total_bytes is None else f"max_total_bytes = {max_total_bytes}\n"
    return f"[fdr]\nsegment_max_bytes = {segment_max_bytes}\n{total}" + MINIMAL


@pytest.mark.parametrize(
    ("segment", "total"),
    [
        (1024, None),  # the default 256 MiB: 262,144 segments
        (1024, (MAX_FDR_SEGMENTS + 1) * 1024),
        (4 * MIB, MAX_DISK_BYTES),  # a TiB of half the default size: 262,144
    ],
)
def test_more_segments_than_the_ceiling_are_refused_at_load_naming_both_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], segment: int, total: int | None
) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(fdr(segment, total))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "fdr.max_total_bytes / fdr.segment_max_bytes" in err
    assert f"must be at most {MAX_FDR_SEGMENTS} segments" in err
    least = -(-(total or 256 * MIB) // MAX_FDR_SEGMENTS)
    assert f"raise fdr.segment_max_bytes to at least {least}" in err
    # ... and the size it names loads
    assert load_text(tmp_path, fdr(least, total)).fdr.segment_max_bytes == least


@pytest.mark.parametrize(
    ("segment", "total"),
    [
        (8 * MIB, MAX_DISK_BYTES),  # the disk ceiling at the default segment size
        (1024, MAX_FDR_SEGMENTS * 1024),
        (2048, None),  # the default total in 2 KiB segments
        (1024, 1 << 20),  # the unit tests' small recorders
    ],
)
def test_up_to_the_ceiling_loads(tmp_path: Path, segment: int, total: int | None) -> None:
    loaded = load_text(tmp_path, fdr(segment, total))
    assert loaded.fdr.max_total_bytes // loaded.fdr.segment_max_bytes <= MAX_FDR_SEGMENTS


def test_the_defaults_keep_few_segments() -> None:
    config = FdrConfig(directory=Path("fdr"))
    assert config.max_total_bytes // config.segment_max_bytes == 32


def test_a_section_built_in_code_is_held_to_it_too() -> None:
    with pytest.raises(ConfigError, match=r"at most 131072 segments"):
        FdrConfig(directory=Path("fdr"), segment_max_bytes=1024)


def test_a_segment_size_refused_on_its_own_is_not_refused_twice(tmp_path: Path) -> None:
    """Under the least (or zero): one message, the size's, and no division by it."""
    for segment in (0, 512):
        with pytest.raises(ConfigError) as refused:
            load_text(tmp_path, fdr(segment))
        assert "segments:" not in str(refused.value)
        assert "fdr.segment_max_bytes" in str(refused.value)
