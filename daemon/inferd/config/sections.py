"""The configuration's sections as frozen dataclasses that validate themselves
(ranges and allowed values, each refusal naming its key; ``every_rule`` runs all
of a section's rules and raises the values they refused together).  ``[bus]`` and
``[shm]`` are ``inferd.config.transport_sections``', re-exported here."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from inferd.config.ceilings import (
    FDR_QUEUE_MIN_BYTES,
    FDR_SEGMENT_MIN_BYTES,
    MAX_ALERT_RATE_LIMIT_S,
    MAX_DEVICE_INDEX,
    MAX_DISK_BYTES,
    MAX_FDR_QUEUE_BYTES,
    MAX_FDR_QUEUE_RECORDS,
    MAX_FDR_SEGMENT_BYTES,
    MAX_FDR_SEGMENTS,
    MAX_FSYNC_INTERVAL_MS,
    MAX_GPU_BUDGET_BYTES,
    MAX_HEALTH_INTERVAL_S,
    MAX_HYSTERESIS_C,
    MAX_LOAD_S,
    MAX_MEMORY_BYTES,
    MAX_QUEUE_CAPACITY,
    MAX_REBUILD_ATTEMPTS,
    MAX_SHUTDOWN_MS,
    MAX_THERMAL_POLL_HZ,
    MAX_THREADS,
    MAX_THROTTLE_ENTER_C,
    MIN_ALERT_RATE_LIMIT_S,
    MIN_HEALTH_INTERVAL_S,
    MIN_THERMAL_POLL_HZ,
    MIN_THROTTLE_ENTER_C,
)
from inferd.config.ceilings import MAX_DEADLINE_MS as MAX_DEADLINE_MS  # bus/codec.py, headers.py
from inferd.config.ceilings import MAX_REGIONS_PER_CONNECTION as MAX_REGIONS_PER_CONNECTION
from inferd.config.checks import (
    between,
    distinct,
    non_negative,
    one_of,
    one_to,
    op_rate,
    positive,
    positive_up_to,
    socket_file,
    up_to,
)
from inferd.config.mavlink_endpoint import endpoint_problem
from inferd.config.metrics import MetricsConfig
from inferd.config.refusals import every_rule, refuse
from inferd.config.security import BuildsConfig, SecurityConfig, is_loopback, tcp_host
from inferd.config.transport_sections import BusConfig as BusConfig
from inferd.config.transport_sections import ShmConfig as ShmConfig
from inferd.types import BuildConfig, OptimizationProfile, PrecisionMode

RUNTIME_LABELS: tuple[str, ...] = ("tensorrt", "onnx_trt_ep")
QUEUE_POLICIES: tuple[str, ...] = ("fifo", "latest")
LOG_FORMATS: tuple[str, ...] = ("auto", "console", "json", "journald")
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
DEFAULT_MODEL_NAME = "demo"
#: A model name: it names a directory and files under ``<state_dir>/builds`` (whose
#: retention matches ``[A-Za-z0-9_-]+`` only, and NAME_MAX is 255 bytes), and it is
#: a metrics label, a journald field, an FDR field and terminal text: ASCII only (no
#: control, look-alike or escape characters), never taken for an option (``-x``).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MODEL_NAME_RULE = "1..64 ASCII letters, digits, '-' or '_', starting with a letter or digit"

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


#: ``[[models]] max_load_s``: ONNX Runtime's TensorRT EP builds its engine while
#: the session loads, reported at 50-60 s on a Xavier NX without a cache and
#: minutes for large models (onnxruntime #7499, its "TensorRT EP Caches" docs).
DEFAULT_MAX_LOAD_S = 600.0


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

    @every_rule
    def __post_init__(self) -> None:
        one_of("daemon.log_level", self.log_level, LOG_LEVELS)
        one_of("daemon.log_format", self.log_format, LOG_FORMATS)
        positive("daemon.health_interval_s", self.health_interval_s)
        between(
            "daemon.health_interval_s",
            self.health_interval_s,
            MIN_HEALTH_INTERVAL_S,
            MAX_HEALTH_INTERVAL_S,
            " s",
        )
        up_to("daemon.shutdown_drain_ms", self.shutdown_drain_ms, MAX_SHUTDOWN_MS, " ms")
        up_to("daemon.shutdown_linger_ms", self.shutdown_linger_ms, MAX_SHUTDOWN_MS, " ms")
        positive("daemon.startup_extend_s", self.startup_extend_s)
        up_to("daemon.startup_extend_s", self.startup_extend_s, MAX_LOAD_S, " s")
        positive("daemon.build_cancel_grace_s", self.build_cancel_grace_s)
        up_to("daemon.build_cancel_grace_s", self.build_cancel_grace_s, MAX_SHUTDOWN_MS / 1000)


@dataclass(frozen=True)
class RuntimeConfig:
    """Settings shared by the runtime strategies (``[runtime]``)."""

    #: Per-strategy build flags: a strategy not listed is never imported.
    enabled: tuple[str, ...] = RUNTIME_LABELS
    gpu_memory_budget_bytes: int = 4 * 1024**3
    ort_trt_cache_dir: Path = Path("ort_trt_cache")
    ort_disallow_cpu_fallback: bool = False
    #: Refuse an ONNX Runtime session without the TensorRT EP (CUDA-only or
    #: CPU-only): the model fails over or is unavailable instead of serving slower.
    ort_require_tensorrt_ep: bool = False
    ort_intra_op_threads: int = 0
    ort_gpu_mem_limit_bytes: int = 0  # the CUDA EP's arena cap; 0: gpu_memory_budget_bytes
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
    #: Consecutive execution failures of a model on ``tensorrt`` (execute
    #: returned False, a CUDA error) that fail it over to ``onnx_trt_ep`` while
    #: serving; a sticky CUDA error fails over at once; 0: never fail over.
    tensorrt_failover_after_errors: int = 3
    #: ``runtime.switch`` a peer may send at once, then one more every ``switch_refill_s``.
    switch_burst: int = 10
    switch_refill_s: float = 6.0

    @every_rule
    def __post_init__(self) -> None:
        for label in self.enabled:
            one_of("runtime.enabled", label, RUNTIME_LABELS)
        distinct("runtime.enabled", self.enabled)
        positive("runtime.gpu_memory_budget_bytes", self.gpu_memory_budget_bytes)
        for key in ("gpu_memory_budget_bytes", "ort_gpu_mem_limit_bytes"):
            up_to(f"runtime.{key}", getattr(self, key), MAX_GPU_BUDGET_BYTES)
        for key in ("ort_trt_cache_dir", "engine_dir"):
            if str(getattr(self, key)).strip() in ("", "."):
                refuse(f"runtime.{key} must name a directory, got an empty path", f"runtime.{key}")
        if self.engine_manifest is not None and str(self.engine_manifest).strip() in ("", "."):
            key = "runtime.engine_manifest"
            refuse(f"{key} must name a file, got an empty path", key)
        up_to("runtime.ort_intra_op_threads", self.ort_intra_op_threads, MAX_THREADS)
        up_to("runtime.device_id", self.device_id, MAX_DEVICE_INDEX)
        up_to("runtime.rebuild_backoff_s", self.rebuild_backoff_s, 86_400)  # and finite
        one_to("runtime.rebuild_max_attempts", self.rebuild_max_attempts, MAX_REBUILD_ATTEMPTS)
        up_to("runtime.tensorrt_failover_after_errors", self.tensorrt_failover_after_errors, 1000)
        op_rate("runtime", "switch", self.switch_burst, self.switch_refill_s)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: Path
    runtime: str = "onnx_trt_ep"
    precision: PrecisionMode = PrecisionMode.FP32
    queue_capacity: int = 64
    #: Tensor bytes the model's queued requests may hold together.
    queue_max_bytes: int = 256 * 1024 * 1024
    queue_policy: QueuePolicy = "fifo"
    default_deadline_ms: int = 0
    staged_engines: tuple[Path, ...] = ()
    #: The one source of this model's optimisation profiles (min/opt/max shape per
    #: input): its engine builds, ONNX Runtime's TensorRT EP options, warm-up (at
    #: opt) and the shapes a request may have.
    profiles: tuple[OptimizationProfile, ...] = ()
    #: How long activating this model (locate, load, warm-up; the fallback's too)
    #: may keep the engine worker busy before the watchdog treats it as stuck.
    max_load_s: float = DEFAULT_MAX_LOAD_S

    @every_rule
    def __post_init__(self) -> None:
        # A name past the rule's length is cut in every message: its repr is the key
        where = f"models[{self.name[:64]!r}{'...' if len(self.name) > 64 else ''}]"
        if not MODEL_NAME.fullmatch(self.name):
            given = f" (got {len(self.name)} characters)" if len(self.name) > 64 else ""
            refuse(f"{where}.name must be {MODEL_NAME_RULE}{given}", f"{where}.name")
        one_of(f"{where}.runtime", self.runtime, RUNTIME_LABELS)
        one_of(f"{where}.queue_policy", self.queue_policy, QUEUE_POLICIES)
        one_to(f"{where}.queue_capacity", self.queue_capacity, MAX_QUEUE_CAPACITY)
        one_to(f"{where}.queue_max_bytes", self.queue_max_bytes, MAX_MEMORY_BYTES)
        up_to(f"{where}.default_deadline_ms", self.default_deadline_ms, MAX_DEADLINE_MS, " ms")
        if len(self.staged_engines) > 1:
            refuse(
                f"{where}.staged_engines: onnx_trt_ep loads one prebuilt engine per model (an "
                f"EP-context model whose one node is the whole graph), got "
                f"{len(self.staged_engines)}: {[str(path) for path in self.staged_engines]}",
                f"{where}.staged_engines",
            )
        positive_up_to(f"{where}.max_load_s", self.max_load_s, MAX_LOAD_S, " s")
        names = [profile.input_name for profile in self.profiles]
        for index, name in enumerate(names):
            if names.index(name) != index:
                refuse(
                    f"{where}.profiles[{index}].input_name: {name!r} already has a profile "
                    f"(profiles[{names.index(name)}]); one profile per input",
                    f"{where}.profiles[{index}].input_name",
                )

    def build_config(self) -> BuildConfig:
        """The build configuration of this model's engine: what the ``tensorrt``
        runtime locates, the background rebuild and ``build.start`` build by default,
        and ``onnx_trt_ep`` loads with."""
        return BuildConfig(precision=self.precision, profiles=self.profiles)


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
    queue_max_bytes: int = 16 * 1024 * 1024

    @every_rule
    def __post_init__(self) -> None:
        positive("fdr.fsync_interval_ms", self.fsync_interval_ms)
        up_to("fdr.fsync_interval_ms", self.fsync_interval_ms, MAX_FSYNC_INTERVAL_MS, " ms")
        if self.segment_max_bytes < FDR_SEGMENT_MIN_BYTES:
            refuse(
                f"fdr.segment_max_bytes ({self.segment_max_bytes}) must be at least "
                f"{FDR_SEGMENT_MIN_BYTES}: a segment must hold the recorder's own records",
                "fdr.segment_max_bytes",
            )
        between(
            "fdr.segment_max_bytes",
            self.segment_max_bytes,
            FDR_SEGMENT_MIN_BYTES,
            MAX_FDR_SEGMENT_BYTES,
        )
        one_to("fdr.queue_capacity", self.queue_capacity, MAX_FDR_QUEUE_RECORDS)
        between(
            "fdr.queue_max_bytes", self.queue_max_bytes, FDR_QUEUE_MIN_BYTES, MAX_FDR_QUEUE_BYTES
        )
        up_to("fdr.max_total_bytes", self.max_total_bytes, MAX_DISK_BYTES)
        if self.max_total_bytes < 2 * self.segment_max_bytes:
            refuse(
                f"fdr.max_total_bytes ({self.max_total_bytes}) must hold at least two segments "
                f"of fdr.segment_max_bytes ({self.segment_max_bytes})",
                "fdr.max_total_bytes",
                "fdr.segment_max_bytes",
            )
        segments = self.max_total_bytes // max(self.segment_max_bytes, FDR_SEGMENT_MIN_BYTES)
        if segments > MAX_FDR_SEGMENTS:  # (a segment under the least was refused above)
            refuse(
                f"fdr.max_total_bytes / fdr.segment_max_bytes ({self.max_total_bytes} / "
                f"{self.segment_max_bytes}) must be at most {MAX_FDR_SEGMENTS} segments: "
                f"raise fdr.segment_max_bytes to at least "
                f"{-(-self.max_total_bytes // MAX_FDR_SEGMENTS)} or lower fdr.max_total_bytes",
                "fdr.max_total_bytes",
                "fdr.segment_max_bytes",
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

    @every_rule
    def __post_init__(self) -> None:
        for hook in self.hooks:
            one_of("alerts.hooks", hook, ALERT_HOOKS)
        distinct("alerts.hooks", self.hooks)
        between(
            "alerts.rate_limit_s",
            self.rate_limit_s,
            MIN_ALERT_RATE_LIMIT_S,
            MAX_ALERT_RATE_LIMIT_S,
            " s",
        )
        # Checked here, not when the hook opens it at start: there a mistake only
        # left the hook out (an ERROR line), and port 99999 was taken, every send failing.
        # The hook's own rule (split_host_port), so nothing passes here that it refuses.
        if (problem := endpoint_problem(self.mavlink_endpoint)) is not None:
            refuse(
                f"alerts.mavlink_endpoint: {self.mavlink_endpoint!r} must be a pymavlink "
                "connection string, udpout:, udpin:, udp: or tcp: then HOST:PORT (port "
                "1..65535, an IPv6 HOST in brackets), such as 'udpout:192.168.1.10:14550' "
                f"({problem})",
                "alerts.mavlink_endpoint",
            )
        if not 1 <= self.mavlink_source_system <= 255:
            refuse("alerts.mavlink_source_system must be 1..255", "alerts.mavlink_source_system")
        if not 1 <= self.mavlink_source_component <= 255:  # 0: MAV_COMP_ID_ALL, a target
            key = "alerts.mavlink_source_component"
            refuse(f"{key} must be 1..255 (0 is MAV_COMP_ID_ALL, not a sender's id)", key)


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
    #: A CUDA device number (as ``runtime.device_id``), not an NVML index: NVML reads
    #: that GPU, found by its PCI bus id.  The key keeps its name for compatibility.
    nvml_device_index: int = 0

    @every_rule
    def __post_init__(self) -> None:
        for source in self.sources:
            one_of("thermal.sources", source, THERMAL_SOURCES)
        distinct("thermal.sources", self.sources)
        between("thermal.poll_hz", self.poll_hz, MIN_THERMAL_POLL_HZ, MAX_THERMAL_POLL_HZ)
        if self.throttle_enter_c is not None:
            enter = self.throttle_enter_c
            between(
                "thermal.throttle_enter_c", enter, MIN_THROTTLE_ENTER_C, MAX_THROTTLE_ENTER_C, " C"
            )
        non_negative("thermal.hysteresis_c", self.hysteresis_c)
        up_to("thermal.hysteresis_c", self.hysteresis_c, MAX_HYSTERESIS_C, " C")
        up_to("thermal.nvml_device_index", self.nvml_device_index, MAX_DEVICE_INDEX)


@dataclass(frozen=True)
class Config:
    daemon: DaemonConfig
    bus: BusConfig
    runtime: RuntimeConfig
    models: tuple[ModelConfig, ...]
    fdr: FdrConfig
    shm: ShmConfig
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    builds: BuildsConfig = field(default_factory=BuildsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    source: str = field(default="<embedded default>", compare=False)

    @every_rule
    def __post_init__(self) -> None:
        if not self.models:
            refuse("config needs at least one [[models]] entry", "models")
        names = [model.name for model in self.models]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            refuse(f"models: duplicate model names {duplicates}", "models")
        for model in self.models:
            if (
                model.runtime not in self.runtime.enabled
                and "onnx_trt_ep" not in self.runtime.enabled
            ):
                refuse(
                    f"models[{model.name!r}].runtime {model.runtime!r} is disabled by "
                    "runtime.enabled and no fallback runtime is enabled",
                    f"models[{model.name!r}].runtime",
                )
        if self.shm.enabled:
            self._shm_socket_apart()
        for key in ("infer_endpoint", "control_endpoint", "events_endpoint"):
            host = tcp_host(getattr(self.bus, key))
            if host is not None and not is_loopback(host) and not self.security.curve:
                refuse(
                    f"bus.{key}: {getattr(self.bus, key)!r} is reachable from other hosts "
                    "and would accept anyone: set security.curve = true (keys: inferd keys "
                    "init; clients: inferd keys client NAME) or bind 127.0.0.1 (docs/SECURITY.md)",
                    f"bus.{key}",
                )

    def _shm_socket_apart(self) -> None:
        """The bus binds first; the shm server then takes a socket file at its path
        for a dead daemon's and replaces it: the bus's clients would reach it."""
        shm = socket_file(f"ipc://{self.shm.socket}")
        for key in ("infer_endpoint", "control_endpoint", "events_endpoint"):
            if socket_file(getattr(self.bus, key)) == shm:
                refuse(
                    f"shm.socket: {str(self.shm.socket)!r} is also the file of bus.{key} "
                    f"({getattr(self.bus, key)!r}): the shm server would replace that "
                    "socket; give it a path of its own",
                    "shm.socket",
                )

    def fingerprint(self) -> str:
        """Stable hash of the effective configuration (for logs and the FDR)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]
