"""Review of config loading, the gaps DESIGN.md 250 left: the disk bounds, the alert
window, the thermal thresholds and the operator ops' refill each get a range, and a
model name a rule (ASCII, at most 64 characters), each refused at load naming the
key and what it may be."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import config
from inferd.config.security import parse_principal
from inferd.engine_build.retention import _ARTIFACT
from inferd.errors import ConfigError
from tests.unit.config.test_review2_config import load_text

TIB = 1024**4
MIB = 1024**2


# -- ranges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # disk bounds: 2**63 - 1 bytes bounded nothing
        (f"[fdr]\nmax_total_bytes = {2**63 - 1}", rf"fdr\.max_total_bytes must be 0\.\.{TIB},"),
        (f"[fdr]\nmax_total_bytes = {TIB + 1}", rf"fdr\.max_total_bytes must be 0\.\.{TIB},"),
        (f"[builds]\nmax_bytes = {2**63 - 1}", rf"builds\.max_bytes must be {MIB}\.\.{TIB},"),
        (f"[builds]\nmax_bytes = {TIB + 1}", rf"builds\.max_bytes must be {MIB}\.\.{TIB},"),
        # 0 was no rate limit at all; a day's window held a fault's repeats back a day
        ("[alerts]\nrate_limit_s = 0", r"alerts\.rate_limit_s must be 1\.0\.\.3600\.0 s, got 0"),
        ("[alerts]\nrate_limit_s = 0.5", r"alerts\.rate_limit_s must be 1\.0\.\.3600\.0 s"),
        ("[alerts]\nrate_limit_s = 86400", r"alerts\.rate_limit_s must be 1\.0\.\.3600\.0 s"),
        # 1e308 never left throttling; a threshold no silicon reaches never entered it
        ("[thermal]\nhysteresis_c = 1e308", r"thermal\.hysteresis_c must be 0\.\.50\.0 C"),
        ("[thermal]\nhysteresis_c = 50.5", r"thermal\.hysteresis_c must be 0\.\.50\.0 C"),
        ("[thermal]\nthrottle_enter_c = 1e308", r"thermal\.throttle_enter_c must be -40\.0\.\.150"),
        ("[thermal]\nthrottle_enter_c = 150.5", r"thermal\.throttle_enter_c must be -40\.0\.\.150"),
        ("[thermal]\nthrottle_enter_c = -273.15", r"thermal\.throttle_enter_c must be -40\.0"),
        # a refill of 1e-9 s left only the burst of 1,000 as a per-peer bound
        (
            "[runtime]\nswitch_refill_s = 1e-9",
            r"runtime\.switch_refill_s must be in \[0\.1, 86400\]",
        ),
        (
            "[runtime]\nswitch_refill_s = 0.099",
            r"runtime\.switch_refill_s must be in \[0\.1, 86400",
        ),
        ("[builds]\nstart_refill_s = 1e-9", r"builds\.start_refill_s must be in \[0\.1, 86400\]"),
    ],
)
def test_a_value_past_its_range_is_refused_naming_the_key_and_the_range(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_text(tmp_path, text)


def test_the_ranges_bounds_load(tmp_path: Path) -> None:
    loaded = load_text(
        tmp_path,
        f"[fdr]\nmax_total_bytes = {TIB}\n"
        f"[builds]\nmax_bytes = {TIB}\nstart_refill_s = 0.1\n"
        "[runtime]\nswitch_refill_s = 0.1\n"
        "[alerts]\nrate_limit_s = 1\n"
        "[thermal]\nhysteresis_c = 50\nthrottle_enter_c = 150\n",
    )
    assert (loaded.fdr.max_total_bytes, loaded.builds.max_bytes) == (TIB, TIB)
    assert (loaded.builds.start_refill_s, loaded.runtime.switch_refill_s) == (0.1, 0.1)
    assert loaded.alerts.rate_limit_s == 1.0
    assert (loaded.thermal.hysteresis_c, loaded.thermal.throttle_enter_c) == (50.0, 150.0)
    other_ends = load_text(
        tmp_path,
        "[alerts]\nrate_limit_s = 3600\n[thermal]\nhysteresis_c = 0\nthrottle_enter_c = -40\n",
    )
    assert other_ends.alerts.rate_limit_s == 3600.0
    assert (other_ends.thermal.hysteresis_c, other_ends.thermal.throttle_enter_c) == (0.0, -40.0)


def test_the_defaults_lie_within_the_ranges(tmp_path: Path) -> None:
    loaded = load_text(tmp_path, "")
    assert loaded.fdr.max_total_bytes <= TIB and loaded.builds.max_bytes <= TIB
    assert 1.0 <= loaded.alerts.rate_limit_s <= 3600.0
    assert loaded.thermal.hysteresis_c <= 50.0
    for refill_s in (loaded.runtime.switch_refill_s, loaded.builds.start_refill_s):
        assert 0.1 <= refill_s <= 86_400.0


def test_the_sections_refuse_what_the_loader_does() -> None:
    # Built in code (tests, tools), not only from a file.
    with pytest.raises(ConfigError, match=r"alerts\.rate_limit_s"):
        config.AlertsConfig(rate_limit_s=0.0)
    with pytest.raises(ConfigError, match=r"thermal\.hysteresis_c"):
        config.ThermalConfig(hysteresis_c=1e308)
    with pytest.raises(ConfigError, match=r"fdr\.max_total_bytes"):
        config.FdrConfig(directory=Path("fdr"), max_total_bytes=2**63 - 1)
    with pytest.raises(ConfigError, match=r"builds\.max_bytes"):
        config.BuildsConfig(max_bytes=2**63 - 1)


# -- model names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "détecteur",  # a Unicode letter: isalnum() took it
        "модель",  # Cyrillic: looks like Latin in a terminal, a label, a file name
        "٣",  # an Arabic-Indic digit
        "x" * 65,  # past the length
        "x" * 10_000,
        "-x",  # taken for an option on a command line
        "_x",
        "a.b",  # the builds' retention matches [A-Za-z0-9_-] only
        "a b",
        "",
    ],
    ids=[
        "latin-1",
        "cyrillic",
        "arabic-digit",
        "65",
        "10000",
        "dash",
        "underscore",
        "dot",
        "space",
        "empty",
    ],
)
def test_a_model_name_past_the_rule_is_refused_naming_the_key_and_the_rule(
    tmp_path: Path, name: str
) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(f'[[models]]\nname = "{name}"\npath = "demo.onnx"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        config.load(path)
    message = str(refused.value)
    assert ".name must be 1..64 ASCII letters, digits, '-' or '_', starting with a letter or" in (
        message
    )
    assert len(message) < 300, message[:300]  # a long name is cut, not repeated whole


@pytest.mark.parametrize("name", ["demo", "a", "Yolo_v8-Det", "0", "x" * 64, "a_-_b"])
def test_a_model_name_within_the_rule_loads(tmp_path: Path, name: str) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(f'[[models]]\nname = "{name}"\npath = "demo.onnx"\n', encoding="utf-8")
    assert [loaded.name for loaded in config.load(path).models] == [name]


@pytest.mark.parametrize("name", ["demo", "Yolo_v8-Det", "x" * 64])
def test_every_name_the_rule_admits_is_one_the_builds_retention_counts(name: str) -> None:
    # <state_dir>/builds/<model>/<model>.<build_id>.* ; within NAME_MAX (255 bytes)
    file_name = f"{name}.b12-0a1b2c.simulated.engine.build.json"
    match = _ARTIFACT.match(file_name)
    assert match is not None and match["model"] == name
    assert len(file_name.encode()) <= 255


def test_a_curve_key_name_with_a_final_newline_is_refused() -> None:
    # KEY_NAME ended in '$', which matches before a final newline: 'key:ops\n' passed
    # and named a key file 'ops\n.key'.
    with pytest.raises(ConfigError, match=r"'key:ops\\n' must be"):
        parse_principal("security.operators[0]", "key:ops\n")
    assert parse_principal("security.operators[0]", "key:ops").ident == "ops"
