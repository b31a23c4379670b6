"""``runtime.switch_burst`` and ``runtime.switch_refill_s``: the per-peer rate of
``runtime.switch``, checked as ``builds.start_burst``/``start_refill_s`` are (one
check, ``checks.op_rate``, the same ceilings: ``MAX_OP_BURST``, ``MAX_OP_REFILL_S``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import config
from inferd.errors import ConfigError
from tests.unit.config.test_security_config import load_text


def test_the_switch_rate_has_defaults_and_is_set_in_runtime(tmp_path: Path) -> None:
    default = load_text(tmp_path, "").runtime
    assert (default.switch_burst, default.switch_refill_s) == (10, 6.0)
    ceiling = load_text(tmp_path, "[runtime]\nswitch_burst = 1000\nswitch_refill_s = 86400").runtime
    assert (ceiling.switch_burst, ceiling.switch_refill_s) == (1000, 86_400.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("switch_burst = 0", r"runtime\.switch_burst must be 1\.\.1000, got 0"),
        ("switch_burst = 1001", r"runtime\.switch_burst must be 1\.\.1000, got 1001"),
        ("switch_burst = 2.0", r"runtime\.switch_burst must be int, got float"),
        (
            "switch_refill_s = 0",
            r"runtime\.switch_refill_s must be in \[0\.1, 86400\] seconds, got 0",
        ),
        ("switch_refill_s = 86400.5", r"runtime\.switch_refill_s must be in \[0\.1, 86400\]"),
        ("switch_refill_s = nan", r"runtime\.switch_refill_s must be a finite number"),
    ],
)
def test_a_rate_that_bounds_nothing_is_refused_naming_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_text(tmp_path, f"[runtime]\n{text}")


@pytest.mark.parametrize("refill_s", [float("nan"), float("inf"), -1.0])
def test_the_dataclass_refuses_what_the_loader_does(refill_s: float) -> None:
    with pytest.raises(ConfigError, match=r"runtime\.switch_refill_s must be in \[0\.1, 86400\]"):
        config.RuntimeConfig(switch_refill_s=refill_s)
    with pytest.raises(ConfigError, match=r"builds\.start_refill_s must be in \[0\.1, 86400\]"):
        config.BuildsConfig(start_refill_s=refill_s)  # the same check, its own key
