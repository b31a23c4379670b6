"""TOML -> ``Config``: every table is read key by key; unknown keys, wrong TOML
types (including ``true`` for an integer) and missing required keys raise
``ConfigError`` naming the key.  Relative model paths resolve against the
config file's directory, relative state paths against the state dir."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # JetPack 6's Python 3.10
    import tomli as tomllib

from inferd.config.metrics import MetricsConfig
from inferd.config.sections import (
    DEFAULT_MAX_LOAD_S,
    DEFAULT_MODEL_NAME,
    RUNTIME_LABELS,
    AlertsConfig,
    BusConfig,
    Config,
    DaemonConfig,
    FdrConfig,
    ModelConfig,
    RuntimeConfig,
    ShmConfig,
    ThermalConfig,
    default_state_dir,
)
from inferd.config.security import (
    SOCKETS,
    BuildsConfig,
    Principal,
    SecurityConfig,
    SocketAccess,
    parse_principal,
    resolve_group,
)
from inferd.errors import ConfigError
from inferd.types import OptimizationProfile, PrecisionMode
from inferd_wire.endpoints import default_endpoints, default_runtime_dir
from inferd_wire.regions import shm_socket_path

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
        _check_scalar(f"{self._where}.{key}", value)
        return value  # type: ignore[no-any-return]

    def take_strings(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.take(key, list, list(default))
        if not all(isinstance(item, str) for item in value):
            raise ConfigError(f"{self._where}.{key} must be a list of strings")
        for index, item in enumerate(value):
            _check_scalar(f"{self._where}.{key}[{index}]", item)
        return tuple(value)

    def take_dims(self, key: str) -> tuple[int, ...]:
        """A required shape: a non-empty list of integers (TOML integers, not ``true``)."""
        value = self.take_required(key, list)
        if not value or not all(
            isinstance(dim, int) and not isinstance(dim, bool) for dim in value
        ):
            raise ConfigError(
                f"{self._where}.{key} must be a non-empty list of integers, got {value!r}"
            )
        for index, dim in enumerate(value):
            if not 0 < dim <= _MAX_DIM:
                raise ConfigError(f"{self._where}.{key}[{index}] must be 1..{_MAX_DIM}, got {dim}")
        return tuple(value)

    @property
    def where(self) -> str:
        return self._where

    def finish(self) -> None:
        if self._data:
            raise ConfigError(f"{self._where}: unknown key(s) {sorted(self._data)}")


#: TOML integers are 64-bit; the daemon hands config integers to C (ZeroMQ options,
#: ONNX Runtime, sizes), so no value may leave that range either way.
_INT64 = range(-(2**63), 2**63)
#: A tensor dimension as the wire and TensorRT's ``Dims`` carry it.
_MAX_DIM = 2**31 - 1


def _check_scalar(key: str, value: object) -> None:
    """What no config value may be, whatever its key: a NaN or infinite float
    (TOML allows ``nan`` and ``inf``), an integer beyond 64 bits, or a string
    with a NUL byte (no path, endpoint or name can hold one)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        raise ConfigError(f"{key} is out of range: {value} does not fit in 64 bits")
    if isinstance(value, str) and "\0" in value:
        raise ConfigError(f"{key} must not contain a NUL byte, got {value!r}")


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
        max_reply_bytes_per_peer=bus_table.take("max_reply_bytes_per_peer", int, 32 * 1024**2),
        max_reply_bytes_total=bus_table.take("max_reply_bytes_total", int, 256 * 1024**2),
        heartbeat_interval_ms=bus_table.take("heartbeat_interval_ms", int, 1000),
        heartbeat_timeout_ms=bus_table.take("heartbeat_timeout_ms", int, 5000),
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
        ort_require_tensorrt_ep=runtime_table.take("ort_require_tensorrt_ep", bool, False),
        ort_intra_op_threads=runtime_table.take("ort_intra_op_threads", int, 0),
        device_id=runtime_table.take("device_id", int, 0),
        engine_dir=_resolve(state_dir, engine_dir),
        # A manifest is a deployment artifact, like a model: relative to the config file.
        engine_manifest=None if engine_manifest == "\0" else _resolve(base_dir, engine_manifest),
        rebuild_on_fallback=runtime_table.take("rebuild_on_fallback", bool, True),
        rebuild_backoff_s=runtime_table.take("rebuild_backoff_s", float, 60.0),
        rebuild_max_attempts=runtime_table.take("rebuild_max_attempts", int, 3),
        tensorrt_failover_after_errors=runtime_table.take("tensorrt_failover_after_errors", int, 3),
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

    security = _security(_Table(top.take("security", dict, {}), "security"), state_dir)
    builds_table = _Table(top.take("builds", dict, {}), "builds")
    build_defaults = BuildsConfig()
    builds = BuildsConfig(
        max_count=builds_table.take("max_count", int, build_defaults.max_count),
        max_bytes=builds_table.take("max_bytes", int, build_defaults.max_bytes),
        start_burst=builds_table.take("start_burst", int, build_defaults.start_burst),
        start_refill_s=builds_table.take("start_refill_s", float, build_defaults.start_refill_s),
    )
    builds_table.finish()
    shm_table = _Table(top.take("shm", dict, {}), "shm")
    shm_defaults = ShmConfig(socket=shm_socket_path(bus.infer_endpoint, runtime_dir))
    shm = ShmConfig(
        socket=_resolve(runtime_dir, shm_table.take("socket", str, str(shm_defaults.socket))),
        enabled=shm_table.take("enabled", bool, shm_defaults.enabled),
        max_connections=shm_table.take("max_connections", int, shm_defaults.max_connections),
        max_regions_per_connection=shm_table.take(
            "max_regions_per_connection", int, shm_defaults.max_regions_per_connection
        ),
        max_bytes_per_uid=shm_table.take("max_bytes_per_uid", int, shm_defaults.max_bytes_per_uid),
        max_bytes_total=shm_table.take("max_bytes_total", int, shm_defaults.max_bytes_total),
    )
    shm_table.finish()

    metrics_table = _Table(top.take("metrics", dict, {}), "metrics")
    textfile_dir = metrics_table.take("textfile_dir", str, "")  # "": no textfile
    if textfile_dir and not textfile_dir.strip():
        raise ConfigError("metrics.textfile_dir must name a directory, got blanks")
    metrics = MetricsConfig(
        listen=metrics_table.take("listen", str, ""),
        allow_non_loopback=metrics_table.take("allow_non_loopback", bool, False),
        textfile_dir=_resolve(state_dir, textfile_dir) if textfile_dir else None,
        textfile_interval_s=metrics_table.take("textfile_interval_s", float, 15.0),
    )
    metrics_table.finish()

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
        shm=shm,
        alerts=alerts,
        thermal=thermal,
        security=security,
        builds=builds,
        metrics=metrics,
        source=source,
    )


def _security(table: _Table, state_dir: Path) -> SecurityConfig:
    """``[security]``: per socket a group and an allow-list, the operators, CURVE."""
    access: dict[str, SocketAccess] = {}
    for name in SOCKETS:
        # NUL cannot occur in a TOML-given name, so it marks "not given".
        group = table.take(f"{name}_group", str, "\0")
        if not group.strip():
            raise ConfigError(f"security.{name}_group must name a group, got an empty string")
        allow = table.take_strings(f"{name}_allow", ())
        access[name] = SocketAccess(
            group=None if group == "\0" else resolve_group(f"security.{name}_group", group),
            group_name=None if group == "\0" else group,
            allow=_principals(f"security.{name}_allow", allow),
        )
    defaults = SecurityConfig()
    secret = table.take("curve_secret_key", str, str(defaults.curve_secret_key))
    clients = table.take("curve_clients_dir", str, str(defaults.curve_clients_dir))
    for key, value in (("curve_secret_key", secret), ("curve_clients_dir", clients)):
        if not value.strip():
            raise ConfigError(f"security.{key} must name a path, got an empty string")
    security = SecurityConfig(
        infer=access["infer"],
        control=access["control"],
        events=access["events"],
        operators=_principals("security.operators", table.take_strings("operators", ())),
        curve=table.take("curve", bool, False),
        curve_secret_key=_resolve(state_dir, secret),
        curve_clients_dir=_resolve(state_dir, clients),
    )
    table.finish()
    return security


def _principals(key: str, texts: tuple[str, ...]) -> tuple[Principal, ...]:
    return tuple(parse_principal(f"{key}[{index}]", text) for index, text in enumerate(texts))


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
        queue_max_bytes=table.take("queue_max_bytes", int, 256 * 1024**2),
        queue_policy=table.take("queue_policy", str, "fifo"),  # type: ignore[arg-type]
        default_deadline_ms=table.take("default_deadline_ms", int, 0),
        staged_engines=tuple(
            _resolve(base_dir, item) for item in table.take_strings("staged_engines", ())
        ),
        profiles=tuple(
            _profile(_Table(item, f"models[{name!r}].profiles[{index}]"))
            for index, item in enumerate(table.take("profiles", list, []))
        ),
        max_load_s=table.take("max_load_s", float, DEFAULT_MAX_LOAD_S),
    )
    table.finish()
    return model


def _profile(table: _Table) -> OptimizationProfile:
    """One ``[[models.profiles]]`` entry: ``input_name`` and ``min_shape``,
    ``opt_shape``, ``max_shape`` (lists of positive integers, one per axis)."""
    name = table.take_required("input_name", str)
    if not name:
        raise ConfigError(f"{table.where}.input_name must name one of the model's inputs")
    shapes = [table.take_dims(key) for key in ("min_shape", "opt_shape", "max_shape")]
    table.finish()
    try:
        return OptimizationProfile(name, shapes[0], shapes[1], shapes[2])
    except ValueError as exc:
        raise ConfigError(f"{table.where}: {exc}") from None


def load(path: Path) -> Config:
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 (TOML files are UTF-8): byte {exc.object[exc.start]:#04x} "
            f"at offset {exc.start}"
        ) from None
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
