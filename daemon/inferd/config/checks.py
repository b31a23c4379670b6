"""The checks a config section makes of one value, each ``ConfigError`` naming
its key."""

from __future__ import annotations

import math

from inferd.errors import ConfigError


def one_of(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}")


def finite(key: str, value: float) -> None:
    # NaN passes every "<= 0" test (all its comparisons are False) and inf is
    # positive: both would reach timers and sleeps as a spin or a hang
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")


def positive(key: str, value: float) -> None:
    finite(key, value)
    if value <= 0:
        raise ConfigError(f"{key} must be positive, got {value}")


def non_negative(key: str, value: float) -> None:
    finite(key, value)
    if value < 0:
        raise ConfigError(f"{key} must be zero or positive, got {value}")


def up_to(key: str, value: float, most: float, unit: str = "") -> None:
    between(key, value, 0, most, unit)


def between(key: str, value: float, least: float, most: float, unit: str = "") -> None:
    finite(key, value)
    if not least <= value <= most:
        raise ConfigError(f"{key} must be {least}..{most}{unit}, got {value}")
