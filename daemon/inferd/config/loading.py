"""TOML -> ``Config``: every table is read key by key; unknown keys, wrong TOML
types (including ``true`` for an integer) and missing required keys raise
``ConfigError`` naming the key.  Relative model paths resolve against the
config file's directory, relative state paths against the state dir."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
from inferd.config.table import ConfigErrors, TomlTable
from inferd.errors import ConfigError
from inferd.owned_files import open_regular_file
from inferd.types import OptimizationProfile, PrecisionMode
from inferd_wire.endpoints import (
    DEFAULT_SEND_BUFFER_BYTES,
    Endpoints,
    default_endpoints,
    default_runtime_dir,
)
from inferd_wire.regions import shm_socket_path


def _resolve(base: Path, value: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else base / path


def _resolve_ipc(base: Path, endpoint: str) -> str:
    """An ``ipc://`` endpoint with a relative path made absolute against ``base``, as
    every path written in the file: libzmq would bind it in the working directory,
    and the shm socket's default is beside it (``shm_socket_path``)."""
    path = endpoint.removeprefix("ipc://")
    if path == endpoint or not path or path.startswith("@"):  # tcp://, or refused later
        return endpoint
    return f"ipc://{_resolve(base, path)}"


def _default_dirs() -> tuple[Path, Path]:
    """The state and runtime dirs the environment names, absolute against the working
    directory as the clients resolve them: only paths written in a config file
    resolve against its directory (a relative one would otherwise resolve twice)."""
    return default_state_dir().absolute(), default_runtime_dir().absolute()


def from_mapping(data: Mapping[str, Any], *, source: str, base_dir: Path) -> Config:
    """Build a Config from parsed TOML; relative paths resolve against ``base_dir``
    (the config file's directory) or, for state files, the state dir.  Every
    mistake is found before any is reported: ``ConfigError`` lists them all."""
    errors = ConfigErrors()
    top = TomlTable(data, "config", errors)
    daemon = errors.section(
        lambda: _daemon(top.table("daemon"), base_dir),
        lambda: DaemonConfig(*_default_dirs()),
    )
    state_dir, runtime_dir = daemon.state_dir, daemon.runtime_dir
    endpoints = default_endpoints(runtime_dir)
    bus = errors.section(
        lambda: _bus(top.table("bus"), endpoints, base_dir),
        lambda: BusConfig(endpoints.infer, endpoints.control, endpoints.events),
    )
    runtime = errors.section(
        lambda: _runtime(top.table("runtime"), state_dir, base_dir), RuntimeConfig
    )
    fdr = errors.section(
        lambda: _fdr(top.table("fdr"), state_dir), lambda: FdrConfig(directory=state_dir / "fdr")
    )
    alerts = errors.section(lambda: _alerts(top.table("alerts"), fdr), AlertsConfig)
    thermal = errors.section(
        lambda: _thermal(top.table("thermal"), runtime, base_dir), ThermalConfig
    )
    security = errors.section(lambda: _security(top.table("security"), state_dir), SecurityConfig)
    builds = errors.section(lambda: _builds(top.table("builds")), BuildsConfig)
    shm_socket = shm_socket_path(bus.infer_endpoint, runtime_dir)
    shm = errors.section(
        lambda: _shm(top.table("shm"), shm_socket, runtime_dir),
        lambda: ShmConfig(socket=shm_socket),
    )
    metrics = errors.section(lambda: _metrics(top.table("metrics"), state_dir), MetricsConfig)
    models: list[ModelConfig] = []
    for index, item in enumerate(top.tables("models")):
        errors.section(
            lambda item=item, index=index: models.append(  # type: ignore[misc]
                _model(TomlTable(item, f"models[{index}]", errors), base_dir)
            ),
            lambda: None,
        )
    top.finish()
    errors.raise_any()
    return Config(
        daemon=daemon,
        bus=bus,
        runtime=runtime,
        models=tuple(models),
        fdr=fdr,
        shm=shm,
        alerts=alerts,
        thermal=thermal,
        security=security,
        builds=builds,
        metrics=metrics,
        source=source,
    )


def _daemon(table: TomlTable, base_dir: Path) -> DaemonConfig:
    default_state, default_runtime = _default_dirs()
    state_dir = _resolve(base_dir, table.take_path("state_dir", str(default_state)))
    runtime_dir = _resolve(base_dir, table.take_path("runtime_dir", str(default_runtime)))
    return table.finish_into(
        DaemonConfig,
        state_dir=state_dir,
        runtime_dir=runtime_dir,
        log_level=table.take("log_level", str, "info"),
        log_format=table.take("log_format", str, "auto"),
        health_interval_s=table.take("health_interval_s", float, 1.0),
        shutdown_drain_ms=table.take("shutdown_drain_ms", int, 2000),
        shutdown_linger_ms=table.take("shutdown_linger_ms", int, 250),
        startup_extend_s=table.take("startup_extend_s", float, 300.0),
        build_cancel_grace_s=table.take("build_cancel_grace_s", float, 10.0),
    )


def _bus(table: TomlTable, endpoints: Endpoints, base_dir: Path) -> BusConfig:
    infer, control, events = (
        _resolve_ipc(base_dir, table.take(f"{name}_endpoint", str, getattr(endpoints, name)))
        for name in ("infer", "control", "events")
    )
    return table.finish_into(
        BusConfig,
        infer_endpoint=infer,
        control_endpoint=control,
        events_endpoint=events,
        max_message_bytes=table.take("max_message_bytes", int, 256 * 1024 * 1024),
        max_header_bytes=table.take("max_header_bytes", int, 64 * 1024),
        max_frames=table.take("max_frames", int, 64),
        max_reply_bytes_per_peer=table.take("max_reply_bytes_per_peer", int, 32 * 1024**2),
        max_reply_bytes_total=table.take("max_reply_bytes_total", int, 256 * 1024**2),
        heartbeat_interval_ms=table.take("heartbeat_interval_ms", int, 1000),
        heartbeat_timeout_ms=table.take("heartbeat_timeout_ms", int, 5000),
        busy_poll_us=table.take("busy_poll_us", int, 50),
        send_buffer_bytes=table.take("send_buffer_bytes", int, DEFAULT_SEND_BUFFER_BYTES),
        max_connections=table.take("max_connections", int, 256),
    )


def _runtime(table: TomlTable, state_dir: Path, base_dir: Path) -> RuntimeConfig:
    cache_dir = table.take_path("ort_trt_cache_dir", "ort_trt_cache")
    engine_dir = table.take_path("engine_dir", "engines")
    engine_manifest = table.take_optional("engine_manifest", str)
    if engine_manifest is not None and not engine_manifest.strip():
        table.errors.add("runtime.engine_manifest must name a file, got an empty string")
        engine_manifest = None
    return table.finish_into(
        RuntimeConfig,
        enabled=table.take_strings("enabled", RUNTIME_LABELS),
        gpu_memory_budget_bytes=table.take("gpu_memory_budget_bytes", int, 4 * 1024**3),
        ort_trt_cache_dir=_resolve(state_dir, cache_dir),
        ort_disallow_cpu_fallback=table.take("ort_disallow_cpu_fallback", bool, False),
        ort_require_tensorrt_ep=table.take("ort_require_tensorrt_ep", bool, False),
        ort_intra_op_threads=table.take("ort_intra_op_threads", int, 0),
        ort_gpu_mem_limit_bytes=table.take("ort_gpu_mem_limit_bytes", int, 0),
        device_id=table.take("device_id", int, 0),
        engine_dir=_resolve(state_dir, engine_dir),
        # A manifest is a deployment artifact, like a model: relative to the config file.
        engine_manifest=None if engine_manifest is None else _resolve(base_dir, engine_manifest),
        rebuild_on_fallback=table.take("rebuild_on_fallback", bool, True),
        rebuild_backoff_s=table.take("rebuild_backoff_s", float, 60.0),
        rebuild_max_attempts=table.take("rebuild_max_attempts", int, 3),
        tensorrt_failover_after_errors=table.take("tensorrt_failover_after_errors", int, 3),
        switch_burst=table.take("switch_burst", int, 10),
        switch_refill_s=table.take("switch_refill_s", float, 6.0),
    )


def _fdr(table: TomlTable, state_dir: Path) -> FdrConfig:
    return table.finish_into(
        FdrConfig,
        directory=_resolve(state_dir, table.take_path("directory", "fdr")),
        enabled=table.take("enabled", bool, True),
        fsync_interval_ms=table.take("fsync_interval_ms", int, 100),
        segment_max_bytes=table.take("segment_max_bytes", int, 8 * 1024 * 1024),
        max_total_bytes=table.take("max_total_bytes", int, 256 * 1024 * 1024),
        queue_capacity=table.take("queue_capacity", int, 4096),
        queue_max_bytes=table.take("queue_max_bytes", int, 16 * 1024 * 1024),
    )


def _alerts(table: TomlTable, fdr: FdrConfig) -> AlertsConfig:
    defaults = AlertsConfig()
    # With the recorder disabled the default hooks leave out 'fdr'; naming it
    # explicitly is still an error below.
    default_hooks = tuple(h for h in defaults.hooks if fdr.enabled or h != "fdr")
    hooks = table.take_strings("hooks", default_hooks)
    if "fdr" in hooks and not fdr.enabled:
        table.errors.add("alerts.hooks includes 'fdr' but fdr.enabled is false")
    return table.finish_into(
        AlertsConfig,
        hooks=hooks,
        rate_limit_s=table.take("rate_limit_s", float, defaults.rate_limit_s),
        mavlink_endpoint=table.take("mavlink_endpoint", str, defaults.mavlink_endpoint),
        mavlink_source_system=table.take(
            "mavlink_source_system", int, defaults.mavlink_source_system
        ),
        mavlink_source_component=table.take(
            "mavlink_source_component", int, defaults.mavlink_source_component
        ),
    )


def _thermal(table: TomlTable, runtime: RuntimeConfig, base_dir: Path) -> ThermalConfig:
    defaults = ThermalConfig()
    return table.finish_into(
        ThermalConfig,
        sources=table.take_strings("sources", defaults.sources),
        poll_hz=table.take("poll_hz", float, defaults.poll_hz),
        sysfs_root=_resolve(base_dir, table.take_path("sysfs_root", str(defaults.sysfs_root))),
        cpu_zones=table.take_strings("cpu_zones", defaults.cpu_zones),
        gpu_zones=table.take_strings("gpu_zones", defaults.gpu_zones),
        throttle_enter_c=table.take_optional("throttle_enter_c", float),
        hysteresis_c=table.take("hysteresis_c", float, defaults.hysteresis_c),
        nvml_device_index=table.take("nvml_device_index", int, runtime.device_id),
    )


def _builds(table: TomlTable) -> BuildsConfig:
    defaults = BuildsConfig()
    return table.finish_into(
        BuildsConfig,
        max_count=table.take("max_count", int, defaults.max_count),
        max_bytes=table.take("max_bytes", int, defaults.max_bytes),
        start_burst=table.take("start_burst", int, defaults.start_burst),
        start_refill_s=table.take("start_refill_s", float, defaults.start_refill_s),
        max_duration_s=table.take("max_duration_s", float, defaults.max_duration_s),
        max_running=table.take("max_running", int, defaults.max_running),
        stall_after_s=table.take("stall_after_s", float, defaults.stall_after_s),
        stall_cancels_after=table.take("stall_cancels_after", int, defaults.stall_cancels_after),
    )


def _shm(table: TomlTable, socket: Path, runtime_dir: Path) -> ShmConfig:
    defaults = ShmConfig(socket=socket)
    return table.finish_into(
        ShmConfig,
        socket=_resolve(runtime_dir, table.take_path("socket", str(defaults.socket), "a socket")),
        enabled=table.take("enabled", bool, defaults.enabled),
        max_connections=table.take("max_connections", int, defaults.max_connections),
        max_connections_per_uid=table.take(
            "max_connections_per_uid", int, defaults.max_connections_per_uid
        ),
        max_regions_per_connection=table.take(
            "max_regions_per_connection", int, defaults.max_regions_per_connection
        ),
        max_requests_per_connection=table.take(
            "max_requests_per_connection", int, defaults.max_requests_per_connection
        ),
        max_bytes_per_uid=table.take("max_bytes_per_uid", int, defaults.max_bytes_per_uid),
        max_bytes_total=table.take("max_bytes_total", int, defaults.max_bytes_total),
    )


def _metrics(table: TomlTable, state_dir: Path) -> MetricsConfig:
    textfile_dir = table.take("textfile_dir", str, "")  # "": no textfile
    if textfile_dir and not textfile_dir.strip():
        table.errors.add("metrics.textfile_dir must name a directory, got blanks")
        textfile_dir = ""
    return table.finish_into(
        MetricsConfig,
        listen=table.take("listen", str, ""),
        allow_non_loopback=table.take("allow_non_loopback", bool, False),
        textfile_dir=_resolve(state_dir, textfile_dir) if textfile_dir else None,
        textfile_interval_s=table.take("textfile_interval_s", float, 15.0),
    )


def _security(table: TomlTable, state_dir: Path) -> SecurityConfig:
    """``[security]``: per socket a group and an allow-list, the operators, CURVE."""
    access: dict[str, SocketAccess] = {}
    for name in SOCKETS:
        group = table.take_optional(f"{name}_group", str)
        if group is not None and not group.strip():
            table.errors.add(f"security.{name}_group must name a group, got an empty string")
            group = None
        allow = table.take_strings(f"{name}_allow", ())
        access[name] = SocketAccess(
            group=None if group is None else resolve_group(f"security.{name}_group", group),
            group_name=group,
            allow=_principals(f"security.{name}_allow", allow),
        )
    defaults = SecurityConfig()
    secret = table.take("curve_secret_key", str, str(defaults.curve_secret_key))
    clients = table.take("curve_clients_dir", str, str(defaults.curve_clients_dir))
    for key, value in (("curve_secret_key", secret), ("curve_clients_dir", clients)):
        if not value.strip():  # recorded; the rest of the section is still checked
            table.errors.add(f"security.{key} must name a path, got an empty string")
    return table.finish_into(
        SecurityConfig,
        infer=access["infer"],
        control=access["control"],
        events=access["events"],
        operators=_principals("security.operators", table.take_strings("operators", ())),
        curve=table.take("curve", bool, False),
        curve_secret_key=_resolve(state_dir, secret),
        curve_clients_dir=_resolve(state_dir, clients),
    )


def _principals(key: str, texts: tuple[str, ...]) -> tuple[Principal, ...]:
    return tuple(parse_principal(f"{key}[{index}]", text) for index, text in enumerate(texts))


def _model(table: TomlTable, base_dir: Path) -> ModelConfig:
    name = table.take_required("name", str)
    precision = table.take("precision", str, "fp32")
    try:
        precision_mode = PrecisionMode(precision)
    except ValueError:
        table.errors.add(
            f"models[{name!r}].precision: {precision!r} is not one of "
            f"{[mode.value for mode in PrecisionMode]}"
        )
        precision_mode = PrecisionMode.FP32
    # A path written empty would name the config file's directory: refused, as for
    # every path key (recorded; the rest of the entry is still checked).
    path = table.take_required("path", str)
    if not path.strip():
        table.refuse("path", f"models[{name!r}].path must name a file, got an empty string")
    staged = table.take_strings("staged_engines", ())
    for index, item in enumerate(staged):
        if not item.strip():
            key = f"staged_engines[{index}]"
            table.refuse(key, f"models[{name!r}].{key} must name a file, got an empty string")
    return table.finish_into(
        ModelConfig,
        name=name,
        path=_resolve(base_dir, path),
        runtime=table.take("runtime", str, "onnx_trt_ep"),
        precision=precision_mode,
        queue_capacity=table.take("queue_capacity", int, 64),
        queue_max_bytes=table.take("queue_max_bytes", int, 256 * 1024**2),
        queue_policy=table.take("queue_policy", str, "fifo"),  # type: ignore[arg-type]
        default_deadline_ms=table.take("default_deadline_ms", int, 0),
        staged_engines=tuple(_resolve(base_dir, item) for item in staged),
        profiles=tuple(
            _profile(TomlTable(item, f"models[{name!r}].profiles[{index}]", table.errors))
            for index, item in enumerate(table.tables("profiles"))
        ),
        max_load_s=table.take("max_load_s", float, DEFAULT_MAX_LOAD_S),
    )


def _profile(table: TomlTable) -> OptimizationProfile:
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


#: The largest config file read: a full config with every key and a few hundred
#: models is tens of KiB; past this it is no config (``/dev/zero`` was read until
#: memory ran out before a file had to be regular).
MAX_CONFIG_BYTES = 1024 * 1024


def load(path: Path) -> Config:
    """The config at ``path``: a regular file of at most ``MAX_CONFIG_BYTES``, opened
    as an operator's file (a symlink followed, DESIGN.md 250) and refused at once when
    it is a FIFO or a device (``open_regular_file``), never waited on."""
    try:
        handle, _info = open_regular_file(path, follow=True)
        with handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"cannot read config {path}: it is larger than {MAX_CONFIG_BYTES} bytes, "
                "which no config is"
            )
        data = tomllib.loads(raw.decode("utf-8"))
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
    state_dir, _runtime_dir = _default_dirs()
    return from_mapping(
        {"models": [{"name": DEFAULT_MODEL_NAME, "path": str(state_dir / "models" / "demo.onnx")}]},
        source="<embedded default>",
        base_dir=state_dir,
    )
