"""``builds.max_duration_s``: the deadline of every daemon build, 4 h unless set,
refused at load (naming the key and its range) when it could bound nothing: not a
positive, finite number of seconds, or past a day (``MAX_BUILD_DURATION_S``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import config
from inferd.config.ceilings import MAX_BUILD_DURATION_S
from inferd.errors import ConfigError
from tests.unit.config.test_security_config import load_text

RANGE = r"builds\.max_duration_s must be in \(0, 86400\] seconds"


def test_every_build_has_a_deadline_of_four_hours_unless_set(tmp_path: Path) -> None:
    assert load_text(tmp_path, "").builds.max_duration_s == 4 * 3600.0
    assert load_text(tmp_path, "[builds]\nmax_duration_s = 90").builds.max_duration_s == 90.0
    ceiling = f"[builds]\nmax_duration_s = {MAX_BUILD_DURATION_S}"
    assert load_text(tmp_path, ceiling).builds.max_duration_s == 86_400.0


@pytest.mark.parametrize("value", ["0", "-1.0", "nan", "inf", "86400.5", "1e300"])
def test_a_deadline_that_bounds_nothing_is_refused_naming_the_key(
    tmp_path: Path, value: str
) -> None:
    # The loader refuses NaN and inf as no finite number, before the range.
    finite = r"builds\.max_duration_s must be a finite number"
    with pytest.raises(ConfigError, match=finite if value in ("nan", "inf") else RANGE):
        load_text(tmp_path, f"[builds]\nmax_duration_s = {value}")
    with pytest.raises(ConfigError, match=RANGE):
        config.BuildsConfig(max_duration_s=float(value))


def test_a_deadline_that_is_no_number_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"builds\.max_duration_s"):
        load_text(tmp_path, '[builds]\nmax_duration_s = "4h"')
