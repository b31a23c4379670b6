"""TOML configuration -> frozen, validated dataclasses.

Every key is checked at load time: unknown keys, wrong types and out-of-range
values raise ``ConfigError`` naming the key, so a typo never silently falls
back to a default on a vehicle.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from inferd.errors import ConfigError
from inferd.types import PrecisionMode
from inferd_wire.endpoints import MAX_IPC_PATH_BYTES, default_endpoints, default_runtime_dir

RUNTIME_LABELS: tuple[str, ...] = ("tensorrt", "onnx_trt_ep")
QUEUE_POLICIES: tuple[str, ...] = ("fifo", "latest")
LOG_FORMATS: tuple[str, ...] = ("auto", "console", "json", "journald")
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
DEFAULT_MODEL_NAME = "demo"

QueuePolicy = Literal["fifo", "latest"]


def default_state_dir() -> Path:
    """``$INFERD_STATE_DIR``, systemd's ``$STATE_DIRECTORY``, ``$XDG_STATE_HOME/inferd``,
    else ``~/.local/state/inferd``."""
    for variable in ("INFERD_STATE_DIR", "STATE_DIRECTORY"):
        value = os.environ.get(variable)
        if value:
            return Path(value.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "inferd"


@dataclass(frozen=True)
class DaemonConfig:
    state_dir: Path
    runtime_dir: Path
    log_level: str = "info"
    #: ``auto``: journald when stderr is connected to the journal (systemd), else console.
    log_format: str = "auto"
    health_interval_s: float = 1.0
    shutdown_drain_ms: int = 2000
    shutdown_linger_ms: int = 250
    #: Under systemd, each step of start-up progress (a model up, a build progress
    #: report) extends the start timeout to at least this long from then.
    startup_extend_s: float = 300.0
    #: ``build.cancel`` and shutdown: how long a build child may take to stop
    #: cooperatively before it is killed (recorded as escalated).
    build_cancel_grace_s: float = 10.0

    def __post_init__(self) -> None:
        _one_of("daemon.log_level", self.log_level, LOG_LEVELS)
        _one_of("daemon.log_format", self.log_format, LOG_FORMATS)
        _positive("daemon.health_interval_s", self.health_interval_s)
        _non_negative("daemon.shutdown_drain_ms", self.shutdown_drain_ms)
        _non_negative("daemon.shutdown_linger_ms", self.shutdown_linger_ms)
        _positive("daemon.startup_extend_s", self.startup_extend_s)
        _positive("daemon.build_cancel_grace_s", self.build_cancel_grace_s)


@dataclass(frozen=True)
class BusConfig:
    infer_endpoint: str
    control_endpoint: str
    events_endpoint: str
    max_message_bytes: int = 256 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_frames: int = 64

    def __post_init__(self) -> None:
        for key in ("infer_endpoint", "control_endpoint", "events_endpoint"):
            _endpoint(f"bus.{key}", getattr(self, key))
        endpoints = [self.infer_endpoint, self.control_endpoint, self.events_endpoint]
        if len(set(endpoints)) != 3:
            raise ConfigError("bus: infer, control and events endpoints must all differ")
        _positive("bus.max_message_bytes", self.max_message_bytes)
        _positive("bus.max_header_bytes", self.max_header_bytes)
        _positive("bus.max_frames", self.max_frames)


@dataclass(frozen=True)
class RuntimeConfig:
    """Settings shared by the runtime strategies (``[runtime]``)."""

    #: Per-strategy build flags: a strategy not listed is never imported.
    enabled: tuple[str, ...] = RUNTIME_LABELS
    gpu_memory_budget_bytes: int = 4 * 1024**3
    ort_trt_cache_dir: Path = Path("ort_trt_cache")
    ort_disallow_cpu_fallback: bool = False
    ort_intra_op_threads: int = 0
    device_id: int = 0
    #: Where the ``tensorrt`` strategy keeps its engines, sidecars, timing and
    #: calibration caches (relative paths resolve against the state dir).
    engine_dir: Path = Path("engines")
    #: The deployment manifest the engine gate trusts; None means
    #: ``<engine_dir>/manifest.json`` if it exists, else an empty manifest
    #: (which refuses every engine at the gate's step 5).
    engine_manifest: Path | None = None
    #: A ``tensorrt`` model serving on the fallback (engine missing, refused or
    #: failed at load) gets its engine built in the background and adopted.
    rebuild_on_fallback: bool = True
    #: Wait before retrying a failed background build; doubles per failure.
    rebuild_backoff_s: float = 60.0
    #: Background builds tried per model before giving up (an alert says so).
    rebuild_max_attempts: int = 3

    def __post_init__(self) -> None:
        for label in self.enabled:
            _one_of("runtime.enabled", label, RUNTIME_LABELS)
        _positive("runtime.gpu_memory_budget_bytes", self.gpu_memory_budget_bytes)
        if str(self.ort_trt_cache_dir).strip() in ("", "."):
            raise ConfigError("runtime.ort_trt_cache_dir must name a directory, got an empty path")
        if str(self.engine_dir).strip() in ("", "."):
            raise ConfigError("runtime.engine_dir must name a directory, got an empty path")
        if self.engine_manifest is not None and str(self.engine_manifest).strip() in ("", "."):
            raise ConfigError("runtime.engine_manifest must name a file, got an empty path")
        _non_negative("runtime.ort_intra_op_threads", self.ort_intra_op_threads)
        _non_negative("runtime.device_id", self.device_id)
        if not 0 <= self.rebuild_backoff_s <= 86_400:
            raise ConfigError(
                f"runtime.rebuild_backoff_s must be 0..86400, got {self.rebuild_backoff_s}"
            )
        _positive("runtime.rebuild_max_attempts", self.rebuild_max_attempts)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: Path
    runtime: str = "onnx_trt_ep"
    precision: PrecisionMode = PrecisionMode.FP32
    queue_capacity: int = 64
    queue_policy: QueuePolicy = "fifo"
    default_deadline_ms: int = 0
    staged_engines: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        where = f"models[{self.name!r}]"
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"{where}.name must be non-empty letters, digits, '-' or '_'")
        _one_of(f"{where}.runtime", self.runtime, RUNTIME_LABELS)
        _one_of(f"{where}.queue_policy", self.queue_policy, QUEUE_POLICIES)
        _positive(f"{where}.queue_capacity", self.queue_capacity)
        _non_negative(f"{where}.default_deadline_ms", self.default_deadline_ms)


ALERT_HOOKS: tuple[str, ...] = ("pub", "fdr", "mavlink")
THERMAL_SOURCES: tuple[str, ...] = ("jtop", "nvml", "sysfs")


@dataclass(frozen=True)
class FdrConfig:
    """Flight data recorder (``[fdr]``)."""

    directory: Path
    enabled: bool = True
    fsync_interval_ms: int = 100
    segment_max_bytes: int = 8 * 1024 * 1024
    max_total_bytes: int = 256 * 1024 * 1024
    queue_capacity: int = 4096

    def __post_init__(self) -> None:
        _positive("fdr.fsync_interval_ms", self.fsync_interval_ms)
        _positive("fdr.segment_max_bytes", self.segment_max_bytes)
        _positive("fdr.queue_capacity", self.queue_capacity)
        if self.max_total_bytes < 2 * self.segment_max_bytes:
            raise ConfigError(
                f"fdr.max_total_bytes ({self.max_total_bytes}) must hold at least two segments "
                f"of fdr.segment_max_bytes ({self.segment_max_bytes})"
            )


@dataclass(frozen=True)
class AlertsConfig:
    """Ground-station alert hooks (``[alerts]``)."""

    hooks: tuple[str, ...] = ("pub", "fdr")
    #: Minimum seconds between two alerts with the same code; repeats inside
    #: the window are counted and reported with the next one that goes out.
    rate_limit_s: float = 10.0
    mavlink_endpoint: str = "udpout:127.0.0.1:14550"
    mavlink_source_system: int = 1
    #: MAV_COMP_ID_ONBOARD_COMPUTER
    mavlink_source_component: int = 191

    def __post_init__(self) -> None:
        for hook in self.hooks:
            _one_of("alerts.hooks", hook, ALERT_HOOKS)
        _non_negative("alerts.rate_limit_s", self.rate_limit_s)
        if not self.mavlink_endpoint.startswith(("udpout:", "udpin:", "tcp:", "udp:")):
            raise ConfigError(
                f"alerts.mavlink_endpoint: {self.mavlink_endpoint!r} must be a pymavlink "
                "connection string such as 'udpout:192.168.1.10:14550'"
            )
        if not 1 <= self.mavlink_source_system <= 255:
            raise ConfigError("alerts.mavlink_source_system must be 1..255")
        if not 0 <= self.mavlink_source_component <= 255:
            raise ConfigError("alerts.mavlink_source_component must be 0..255")


@dataclass(frozen=True)
class ThermalConfig:
    """Thermal telemetry (``[thermal]``)."""

    sources: tuple[str, ...] = THERMAL_SOURCES
    poll_hz: float = 1.0
    sysfs_root: Path = Path("/sys/class/thermal")
    #: Zone ``type`` names, matched by name and never by zone number.
    cpu_zones: tuple[str, ...] = ("cpu-thermal", "CPU-therm", "x86_pkg_temp")
    gpu_zones: tuple[str, ...] = ("gpu-thermal", "GPU-therm")
    #: Throttle threshold when the source reports no throttle bits; default:
    #: the zone's lowest ``passive`` trip point.
    throttle_enter_c: float | None = None
    hysteresis_c: float = 5.0
    nvml_device_index: int = 0

    def __post_init__(self) -> None:
        for source in self.sources:
            _one_of("thermal.sources", source, THERMAL_SOURCES)
        _positive("thermal.poll_hz", self.poll_hz)
        _non_negative("thermal.hysteresis_c", self.hysteresis_c)
        _non_negative("thermal.nvml_device_index", self.nvml_device_index)


@dataclass(frozen=True)
class Config:
    daemon: DaemonConfig
    bus: BusConfig
    runtime: RuntimeConfig
    models: tuple[ModelConfig, ...]
    fdr: FdrConfig
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    source: str = field(default="<embedded default>", compare=False)

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("config needs at least one [[models]] entry")
        names = [model.name for model in self.models]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"models: duplicate model names {duplicates}")
        for model in self.models:
            if (
                model.runtime not in self.runtime.enabled
                and "onnx_trt_ep" not in self.runtime.enabled
            ):
                raise ConfigError(
                    f"models[{model.name!r}].runtime {model.runtime!r} is disabled by "
                    "runtime.enabled and no fallback runtime is enabled"
                )

    def fingerprint(self) -> str:
        """Stable hash of the effective configuration (for logs and the FDR)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


def _one_of(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}")


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be positive, got {value}")


def _non_negative(key: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{key} must be zero or positive, got {value}")


def _endpoint(key: str, value: str) -> None:
    if value.startswith("ipc://"):
        path = value.removeprefix("ipc://")
        if not path or path.startswith("@"):
            raise ConfigError(
                f"{key}: {value!r}: ipc endpoints must be filesystem paths (abstract sockets "
                "have no permissions)"
            )
        if len(path.encode()) > MAX_IPC_PATH_BYTES:
            raise ConfigError(
                f"{key}: ipc path is {len(path.encode())} bytes; Unix sockets allow "
                f"{MAX_IPC_PATH_BYTES}"
            )
    elif not value.startswith("tcp://"):
        raise ConfigError(f"{key}: {value!r} must start with ipc:// or tcp://")


T = TypeVar("T")


class _Table:
    """Reads one TOML table, type-checks each key and rejects unknown ones."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a table")
        self._data: dict[str, Any] = dict(data)
        self._where = where

    def take(self, key: str, kind: type[T], default: T) -> T:
        if key not in self._data:
            return default
        return self._convert(key, self._data.pop(key), kind)

    def take_required(self, key: str, kind: type[T]) -> T:
        if key not in self._data:
            raise ConfigError(f"{self._where}.{key} is required")
        return self._convert(key, self._data.pop(key), kind)

    def _convert(self, key: str, value: Any, kind: type[T]) -> T:
        # bool is an int subclass in Python; TOML keeps them apart, so do we.
        if isinstance(value, bool) and kind is not bool:
            ok = False
        elif kind is float and isinstance(value, int):
            value, ok = float(value), True
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise ConfigError(
                f"{self._where}.{key} must be {kind.__name__}, got {type(value).__name__} {value!r}"
            )
        return value  # type: ignore[no-any-return]

    def take_strings(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.take(key, list, list(default))
        if not all(isinstance(item, str) for item in value):
            raise ConfigError(f"{self._where}.{key} must be a list of strings")
        return tuple(value)

    def finish(self) -> None:
        if self._data:
            raise ConfigError(f"{self._where}: unknown key(s) {sorted(self._data)}")


def _resolve(base: Path, value: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else base / path


def from_mapping(data: Mapping[str, Any], *, source: str, base_dir: Path) -> Config:
    """Build a Config from parsed TOML; relative paths resolve against ``base_dir``
    (the config file's directory) or, for state files, the state dir."""
    top = _Table(data, "config")
    daemon_table = _Table(top.take("daemon", dict, {}), "daemon")
    state_dir = _resolve(base_dir, daemon_table.take("state_dir", str, str(default_state_dir())))
    runtime_dir = _resolve(
        base_dir, daemon_table.take("runtime_dir", str, str(default_runtime_dir()))
    )
    daemon = DaemonConfig(
        state_dir=state_dir,
        runtime_dir=runtime_dir,
        log_level=daemon_table.take("log_level", str, "info"),
        log_format=daemon_table.take("log_format", str, "auto"),
        health_interval_s=daemon_table.take("health_interval_s", float, 1.0),
        shutdown_drain_ms=daemon_table.take("shutdown_drain_ms", int, 2000),
        shutdown_linger_ms=daemon_table.take("shutdown_linger_ms", int, 250),
        startup_extend_s=daemon_table.take("startup_extend_s", float, 300.0),
        build_cancel_grace_s=daemon_table.take("build_cancel_grace_s", float, 10.0),
    )
    daemon_table.finish()

    endpoints = default_endpoints(runtime_dir)
    bus_table = _Table(top.take("bus", dict, {}), "bus")
    bus = BusConfig(
        infer_endpoint=bus_table.take("infer_endpoint", str, endpoints.infer),
        control_endpoint=bus_table.take("control_endpoint", str, endpoints.control),
        events_endpoint=bus_table.take("events_endpoint", str, endpoints.events),
        max_message_bytes=bus_table.take("max_message_bytes", int, 256 * 1024 * 1024),
        max_header_bytes=bus_table.take("max_header_bytes", int, 64 * 1024),
        max_frames=bus_table.take("max_frames", int, 64),
    )
    bus_table.finish()

    runtime_table = _Table(top.take("runtime", dict, {}), "runtime")
    cache_dir = runtime_table.take("ort_trt_cache_dir", str, "ort_trt_cache")
    if not cache_dir.strip():
        raise ConfigError("runtime.ort_trt_cache_dir must name a directory, got an empty string")
    engine_dir = runtime_table.take("engine_dir", str, "engines")
    if not engine_dir.strip():
        raise ConfigError("runtime.engine_dir must name a directory, got an empty string")
    # NUL cannot occur in a TOML-given path, so it marks "not given".
    engine_manifest = runtime_table.take("engine_manifest", str, "\0")
    if not engine_manifest.strip():
        raise ConfigError("runtime.engine_manifest must name a file, got an empty string")
    runtime = RuntimeConfig(
        enabled=runtime_table.take_strings("enabled", RUNTIME_LABELS),
        gpu_memory_budget_bytes=runtime_table.take("gpu_memory_budget_bytes", int, 4 * 1024**3),
        ort_trt_cache_dir=_resolve(state_dir, cache_dir),
        ort_disallow_cpu_fallback=runtime_table.take("ort_disallow_cpu_fallback", bool, False),
        ort_intra_op_threads=runtime_table.take("ort_intra_op_threads", int, 0),
        device_id=runtime_table.take("device_id", int, 0),
        engine_dir=_resolve(state_dir, engine_dir),
        # A manifest is a deployment artifact, like a model: relative to the config file.
        engine_manifest=None if engine_manifest == "\0" else _resolve(base_dir, engine_manifest),
        rebuild_on_fallback=runtime_table.take("rebuild_on_fallback", bool, True),
        rebuild_backoff_s=runtime_table.take("rebuild_backoff_s", float, 60.0),
        rebuild_max_attempts=runtime_table.take("rebuild_max_attempts", int, 3),
    )
    runtime_table.finish()

    fdr_table = _Table(top.take("fdr", dict, {}), "fdr")
    fdr = FdrConfig(
        directory=_resolve(state_dir, fdr_table.take("directory", str, "fdr")),
        enabled=fdr_table.take("enabled", bool, True),
        fsync_interval_ms=fdr_table.take("fsync_interval_ms", int, 100),
        segment_max_bytes=fdr_table.take("segment_max_bytes", int, 8 * 1024 * 1024),
        max_total_bytes=fdr_table.take("max_total_bytes", int, 256 * 1024 * 1024),
        queue_capacity=fdr_table.take("queue_capacity", int, 4096),
    )
    fdr_table.finish()

    alerts_table = _Table(top.take("alerts", dict, {}), "alerts")
    alert_defaults = AlertsConfig()
    # With the recorder disabled the default hooks leave out 'fdr'; naming it
    # explicitly is still an error below.
    default_hooks = tuple(h for h in alert_defaults.hooks if fdr.enabled or h != "fdr")
    alerts = AlertsConfig(
        hooks=alerts_table.take_strings("hooks", default_hooks),
        rate_limit_s=alerts_table.take("rate_limit_s", float, alert_defaults.rate_limit_s),
        mavlink_endpoint=alerts_table.take(
            "mavlink_endpoint", str, alert_defaults.mavlink_endpoint
        ),
        mavlink_source_system=alerts_table.take(
            "mavlink_source_system", int, alert_defaults.mavlink_source_system
        ),
        mavlink_source_component=alerts_table.take(
            "mavlink_source_component", int, alert_defaults.mavlink_source_component
        ),
    )
    alerts_table.finish()
    if "fdr" in alerts.hooks and not fdr.enabled:
        raise ConfigError("alerts.hooks includes 'fdr' but fdr.enabled is false")

    thermal_table = _Table(top.take("thermal", dict, {}), "thermal")
    thermal_defaults = ThermalConfig()
    enter_c = thermal_table.take("throttle_enter_c", float, -1.0)
    thermal = ThermalConfig(
        sources=thermal_table.take_strings("sources", thermal_defaults.sources),
        poll_hz=thermal_table.take("poll_hz", float, thermal_defaults.poll_hz),
        sysfs_root=Path(thermal_table.take("sysfs_root", str, str(thermal_defaults.sysfs_root))),
        cpu_zones=thermal_table.take_strings("cpu_zones", thermal_defaults.cpu_zones),
        gpu_zones=thermal_table.take_strings("gpu_zones", thermal_defaults.gpu_zones),
        throttle_enter_c=None if enter_c == -1.0 else enter_c,
        hysteresis_c=thermal_table.take("hysteresis_c", float, thermal_defaults.hysteresis_c),
        nvml_device_index=thermal_table.take("nvml_device_index", int, runtime.device_id),
    )
    thermal_table.finish()

    models_data = top.take("models", list, [])
    models = tuple(
        _model(_Table(item, f"models[{index}]"), base_dir) for index, item in enumerate(models_data)
    )
    top.finish()
    return Config(
        daemon=daemon,
        bus=bus,
        runtime=runtime,
        models=models,
        fdr=fdr,
        alerts=alerts,
        thermal=thermal,
        source=source,
    )


def _model(table: _Table, base_dir: Path) -> ModelConfig:
    name = table.take_required("name", str)
    precision = table.take("precision", str, "fp32")
    try:
        precision_mode = PrecisionMode(precision)
    except ValueError:
        raise ConfigError(
            f"models[{name!r}].precision: {precision!r} is not one of "
            f"{[mode.value for mode in PrecisionMode]}"
        ) from None
    model = ModelConfig(
        name=name,
        path=_resolve(base_dir, table.take_required("path", str)),
        runtime=table.take("runtime", str, "onnx_trt_ep"),
        precision=precision_mode,
        queue_capacity=table.take("queue_capacity", int, 64),
        queue_policy=table.take("queue_policy", str, "fifo"),  # type: ignore[arg-type]
        default_deadline_ms=table.take("default_deadline_ms", int, 0),
        staged_engines=tuple(
            _resolve(base_dir, item) for item in table.take_strings("staged_engines", ())
        ),
    )
    table.finish()
    return model


def load(path: Path) -> Config:
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    return from_mapping(data, source=str(path), base_dir=path.resolve().parent)


def embedded_default() -> Config:
    """What ``inferd run`` serves without ``--config``: the demo model in the
    per-user state dir, ``ipc://`` sockets in the per-user runtime dir."""
    state_dir = default_state_dir()
    return from_mapping(
        {"models": [{"name": DEFAULT_MODEL_NAME, "path": str(state_dir / "models" / "demo.onnx")}]},
        source="<embedded default>",
        base_dir=state_dir,
    )
