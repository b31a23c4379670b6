"""The error family (``inferd.errors``)."""

from __future__ import annotations

from inferd import errors


def test_error_family_has_one_root() -> None:
    family = [
        errors.EngineBuildError,
        errors.EngineDeserializeError,
        errors.EngineHashMismatchError,
        errors.EngineSchemaMismatchError,
        errors.EngineSidecarMissingError,
        errors.CalibrationCacheError,
        errors.InferenceError,
        errors.OutOfMemoryError,
        errors.TelemetryUnavailableError,
    ]
    assert all(issubclass(kind, errors.InferdError) for kind in family)
    assert not issubclass(errors.RuntimeNotAvailableError, errors.InferdError)
    assert errors.EngineHashMismatchError("x", stage="sidecar").stage == "sidecar"
