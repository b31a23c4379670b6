"""A model slot: one configured model, its runtime and resident engine, and failover.

Activation runs on the engine-worker thread (all runtime calls do).  Other
threads only read the slot's published fields, each replaced atomically.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from inferd.config import ModelConfig, RuntimeConfig
from inferd.errors import (
    EngineDeserializeError,
    EngineHashMismatchError,
    EngineMissingError,
    EngineSchemaMismatchError,
    EngineSidecarMissingError,
    InferdError,
    RuntimeNotAvailableError,
)
from inferd.runtime import InferenceRuntime, build_inference_runtime
from inferd.serving.stats import ModelStats
from inferd.types import (
    Alert,
    AlertSink,
    EngineHandle,
    EventSink,
    RecordSink,
    ThermalState,
)

FALLBACK_LABEL = "onnx_trt_ep"
#: ``ModelSlot.fallback_cause`` after a failover while serving (``serving/failover.py``).
EXECUTION = "execution"
#: The causes of a fallback that a build of the engine fixes, so the background rebuild
#: (``serving/rebuild.py``) asks for one: no engine for this host (or one ``locate``
#: moved aside), one the gate refused, one TensorRT could not deserialise, warm up or
#: run.  Any other (TensorRT disabled by ``runtime.enabled`` or not importable, pycuda
#: missing, a CUDA device that cannot open, ``runtime.gpu_memory_budget_bytes``, an
#: unreadable host tuple or manifest, an unsafe directory) refuses a rebuilt engine the
#: same way: building it would spend minutes of the GPU the models share for nothing.
BUILD_FIXES = frozenset(
    {
        *(
            kind.__name__
            for kind in (
                EngineMissingError,
                EngineHashMismatchError,
                EngineSchemaMismatchError,
                EngineSidecarMissingError,
                EngineDeserializeError,
            )
        ),
        EXECUTION,
    }
)

log = structlog.get_logger("inferd.slot")


@dataclass(frozen=True)
class Sinks:
    """Where a slot's runtime sends what it has to say."""

    alert: AlertSink
    events: EventSink
    record: RecordSink
    thermal: Callable[[], ThermalState]


class ModelSlot:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.name = config.name
        self.state = "loading"
        self.runtime: InferenceRuntime | None = None
        self.handle: EngineHandle | None = None
        self.last_error: str | None = None
        #: Why the model last fell back or failed over (``BUILD_FIXES``): the type name of
        #: what its configured runtime's preparation raised, or ``EXECUTION``; None after
        #: an operator's switch.
        self.fallback_cause: str | None = None
        self.stats = ModelStats()
        #: Consecutive execution failures on ``tensorrt`` (engine worker only;
        #: ``serving/failover.py``).
        self.execution_failures = 0

    @property
    def is_fallback(self) -> bool:
        return self.handle is not None and self.handle.is_fallback

    def activate(self, runtime_config: RuntimeConfig, sinks: Sinks) -> None:
        """Bring the configured runtime up; fail over to ``onnx_trt_ep`` if it cannot serve."""
        label = self.config.runtime
        sinks = self._naming_model(sinks)
        try:
            self._load(label, runtime_config, False, sinks)
        except (RuntimeNotAvailableError, InferdError) as exc:
            reason = str(exc)
            if label == FALLBACK_LABEL:
                self._fail(reason, sinks)
                return
            log.warning(
                "runtime_unavailable_failing_over", model=self.name, runtime=label, reason=reason
            )
            try:
                self._load(FALLBACK_LABEL, runtime_config, True, sinks)
            except (RuntimeNotAvailableError, InferdError) as fallback_exc:
                self._fail(f"{reason}; fallback failed: {fallback_exc}", sinks)
                return
            self.last_error, self.fallback_cause = reason, type(exc).__name__
            assert self.handle is not None
            sinks.record(
                "fallback_to_onnx_trt_ep",
                {
                    "model": self.name,
                    "configured_runtime": label,
                    "reason": reason,
                    "active_providers": list(self.handle.active_providers),
                    "cause": "load",
                },
            )
        self.state = "serving"
        sinks.events("runtime", self.describe_runtime())

    def _naming_model(self, sinks: Sinks) -> Sinks:
        """Runtimes know engines, not model names: every alert and record they
        raise for this slot names the model so an operator can tell which one degraded."""

        def alert(raised: Alert) -> None:
            sinks.alert(dataclasses.replace(raised, fields={"model": self.name, **raised.fields}))

        def record(kind: str, payload: Mapping[str, Any]) -> None:
            sinks.record(kind, {**payload, "model": self.name})

        return dataclasses.replace(sinks, alert=alert, record=record)

    def _load(
        self, label: str, runtime_config: RuntimeConfig, is_fallback: bool, sinks: Sinks
    ) -> None:
        self.runtime, self.handle = self.prepare(label, runtime_config, sinks, is_fallback)

    def prepare(
        self,
        label: str,
        runtime_config: RuntimeConfig,
        sinks: Sinks,
        is_fallback: bool = False,
    ) -> tuple[InferenceRuntime, EngineHandle]:
        """Build ``label``'s runtime and make this model's engine resident and warm,
        without touching what serves now.  Raises RuntimeNotAvailableError or InferdError
        only, so that every caller treats any failure as a failed preparation."""
        try:
            runtime = build_inference_runtime(
                label,
                runtime_config,
                is_fallback=is_fallback,
                alert=sinks.alert,
                record=sinks.record,
                thermal=sinks.thermal,
            )
            entry = runtime.compile_engine(self.config.path, self.config.build_config())
            entry = dataclasses.replace(entry, staged_engines=self.config.staged_engines)
            return runtime, runtime.deserialize_engine(entry)
        except (RuntimeNotAvailableError, InferdError):
            raise
        except Exception as exc:
            # A strategy let its library's error escape (runtime/interface.py forbids
            # it): a bug to fix, but still a failed preparation, so an activation fails
            # the model instead of killing the worker, and a failover drops the model
            # instead of leaving it on the engine that failed.
            log.exception("runtime_preparation_crashed", model=self.name, runtime=label)
            raise InferdError(f"preparing {label} failed unexpectedly: {exc!r}") from exc

    def swap(
        self,
        runtime: InferenceRuntime,
        handle: EngineHandle,
        reason: str | None = None,
        cause: str | None = None,
    ) -> tuple[InferenceRuntime | None, EngineHandle | None]:
        """Serve from ``runtime``/``handle`` from the next request on (``reason``,
        ``cause``: why it failed over, for a failover); returns the previous pair for
        the caller to release.  Call on the engine worker only."""
        previous = self.runtime, self.handle
        self.runtime, self.handle = runtime, handle
        self.last_error, self.fallback_cause = reason, cause
        self.execution_failures = 0
        self.state = "serving"
        return previous

    def drop(
        self, reason: str, sinks: Sinks
    ) -> tuple[InferenceRuntime | None, EngineHandle | None]:
        """Serve nothing from the next request on: the model failed (alert, event);
        returns the previous pair for the caller to release.  Engine worker only."""
        previous = self.runtime, self.handle
        self.runtime, self.handle = None, None
        self._fail(reason, self._naming_model(sinks))
        return previous

    def sinks_for_model(self, sinks: Sinks) -> Sinks:
        return self._naming_model(sinks)

    def _fail(self, reason: str, sinks: Sinks) -> None:
        self.state = "failed"
        self.last_error = reason
        log.error("model_unavailable", model=self.name, reason=reason)
        sinks.alert(
            Alert("ERROR", "model_unavailable", f"model {self.name!r} cannot serve: {reason}")
        )
        sinks.events("runtime", self.describe_runtime())

    def release(self) -> None:
        if self.runtime is not None and self.handle is not None:
            self.runtime.release_engine(self.handle)
        self.state = "released"
        self.handle = None

    def describe_runtime(self) -> dict[str, Any]:
        handle = self.handle
        return {
            "model": self.name,
            "state": self.state,
            "configured_runtime": self.config.runtime,
            "runtime": handle.runtime_label if handle else None,
            "fallback": self.is_fallback,
            "active_providers": list(handle.active_providers) if handle else [],
            "requested_providers": _requested(handle),
            "provider_degradation": handle.provider_degradation if handle else None,
            "engine_cache_error": handle.engine_cache_error if handle else None,
            "reason": self.last_error,
        }

    def describe_io(self) -> dict[str, Any]:
        handle = self.handle
        return {
            "name": self.name,
            "state": self.state,
            "inputs": [spec.as_wire() for spec in handle.inputs] if handle else [],
            "outputs": [spec.as_wire() for spec in handle.outputs] if handle else [],
        }


def _requested(handle: EngineHandle | None) -> list[str]:
    if handle is None:
        return []
    requested = handle.requested_providers
    return list(handle.active_providers if requested is None else requested)


def engine_files(slots: Iterable[ModelSlot]) -> list[Path]:
    """The engine files the slots serve from (never removed by the builds-dir cap)."""
    return [
        slot.handle.engine_path
        for slot in slots
        if slot.handle is not None and slot.handle.engine_path is not None
    ]
