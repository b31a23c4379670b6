"""The inferd error family.  Every runtime failure is an ``InferdError``."""

from __future__ import annotations


class InferdError(Exception):
    """Root of every error a component raises while serving."""


class EngineBuildError(InferdError):
    pass


class EngineDeserializeError(InferdError):
    pass


class EngineHashMismatchError(InferdError):
    def __init__(self, message: str, *, stage: str = "") -> None:
        super().__init__(message)
        self.stage = stage


class EngineSchemaMismatchError(InferdError):
    pass


class EngineSidecarMissingError(InferdError):
    pass


class CalibrationCacheError(InferdError):
    pass


class InferenceError(InferdError):
    pass


class OutOfMemoryError(InferdError):
    pass


class TelemetryUnavailableError(InferdError):
    pass


class RuntimeNotAvailableError(Exception):
    """A runtime strategy cannot be composed here (disabled, or its library is
    missing).  Raised at composition time, hence outside ``InferdError``."""

    def __init__(self, label: str, reason: str) -> None:
        super().__init__(f"runtime {label!r} is not available: {reason}")
        self.label = label
        self.reason = reason


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the rule."""
