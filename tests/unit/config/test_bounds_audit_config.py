"""Every ``[shm]`` limit on what a client can make the daemon hold has a ceiling:
``shm.max_regions_per_connection`` had none, so a config could promise a bound of
``shm.max_connections`` x 2**62 mappings, each a descriptor (CPython's
``mmap.mmap(fd)`` keeps a ``dup``) and a map entry (``vm.max_map_count``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.config.sections import MAX_REGIONS_PER_CONNECTION
from inferd.errors import ConfigError
from tests.unit.config.test_config import MINIMAL, load_text


def test_regions_per_connection_has_a_ceiling_and_the_ceiling_is_accepted(tmp_path: Path) -> None:
    assert MAX_REGIONS_PER_CONNECTION == 1024
    text = f"[shm]\nmax_regions_per_connection = {MAX_REGIONS_PER_CONNECTION}\n" + MINIMAL
    assert load_text(tmp_path, text).shm.max_regions_per_connection == MAX_REGIONS_PER_CONNECTION
    for value in (MAX_REGIONS_PER_CONNECTION + 1, 2**62):
        with pytest.raises(ConfigError, match=r"shm\.max_regions_per_connection must be 1\.\.1024"):
            load_text(tmp_path, f"[shm]\nmax_regions_per_connection = {value}\n" + MINIMAL)
