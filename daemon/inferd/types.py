"""Plain data passed between components.  Imports nothing from inferd."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import numpy as np

from inferd_wire.compat import StrEnum


class PrecisionMode(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    MIXED = "mixed"


@dataclass(frozen=True)
class OptimizationProfile:
    """min/opt/max shape per dynamic input, as TensorRT optimisation profiles take them."""

    input_name: str
    min_shape: tuple[int, ...]
    opt_shape: tuple[int, ...]
    max_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = {len(self.min_shape), len(self.opt_shape), len(self.max_shape)}
        if len(ranks) != 1:
            raise ValueError(f"profile {self.input_name!r}: min/opt/max shapes differ in rank")
        for low, opt, high in zip(self.min_shape, self.opt_shape, self.max_shape, strict=True):
            if not 0 < low <= opt <= high:
                raise ValueError(
                    f"profile {self.input_name!r}: need 0 < min <= opt <= max per dimension, "
                    f"got {self.min_shape} / {self.opt_shape} / {self.max_shape}"
                )


@dataclass(frozen=True)
class BuildConfig:
    precision: PrecisionMode = PrecisionMode.FP32
    workspace_bytes: int = 1 << 30
    optimization_level: int = 3
    profiles: tuple[OptimizationProfile, ...] = ()

    def __post_init__(self) -> None:
        if self.workspace_bytes <= 0:
            raise ValueError(f"workspace_bytes must be positive, got {self.workspace_bytes}")
        if not 0 <= self.optimization_level <= 5:
            raise ValueError(f"optimization_level must be 0..5, got {self.optimization_level}")


#: Field grammars of a ``HostTuple``; every value is file-name safe and never
#: contains ``_`` (the engine file name's field separator, see ``inferd.engines.naming``).
GPU_SKU_PATTERN = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
GPU_SKU_MAX_CHARS = 40
PLATFORM_PATTERN = re.compile(r"none|r(?:0|[1-9][0-9]{0,3})(?:\.(?:0|[1-9][0-9]{0,3})){0,3}")
TENSORRT_VERSION_PATTERN = re.compile(r"(?:0|[1-9][0-9]{0,3})(?:\.[0-9a-z]{1,12}){2,4}")


@dataclass(frozen=True)
class HostTuple:
    """What a TensorRT engine is bound to: the GPU (compute capability and a
    sanitized SKU name), the platform release (``r36.4.0`` from L4T's
    ``/etc/nv_tegra_release``, ``none`` off Jetson), the full TensorRT version
    (``10.3.0.30``) and the precision the caller asks for.

    ``inferd.engines.read_host_tuple`` reads it from the host; an engine file
    name encodes the one it was built for (``inferd.engines.naming``).
    """

    compute_capability: tuple[int, int]
    gpu_sku: str
    platform: str
    tensorrt_version: str
    precision: PrecisionMode

    def __post_init__(self) -> None:
        capability = self.compute_capability
        if (
            not isinstance(capability, tuple)
            or len(capability) != 2
            or not all(type(part) is int and 0 <= part <= 99 for part in capability)
        ):
            raise ValueError(f"compute capability must be two integers 0..99, got {capability!r}")
        if not GPU_SKU_PATTERN.fullmatch(self.gpu_sku) or len(self.gpu_sku) > GPU_SKU_MAX_CHARS:
            raise ValueError(
                f"GPU SKU {self.gpu_sku!r} must be 1..{GPU_SKU_MAX_CHARS} lowercase letters and "
                "digits in '-'-separated words (see inferd.engines.sanitize_sku)"
            )
        if not PLATFORM_PATTERN.fullmatch(self.platform):
            raise ValueError(f"platform release {self.platform!r} must be 'none' or like 'r36.4.0'")
        if not TENSORRT_VERSION_PATTERN.fullmatch(self.tensorrt_version):
            raise ValueError(
                f"TensorRT version {self.tensorrt_version!r} is not a full version such as "
                "'10.3.0.30' (at least major.minor.patch, lowercase)"
            )
        if not isinstance(self.precision, PrecisionMode):
            raise ValueError(f"precision must be a PrecisionMode, got {self.precision!r}")

    @property
    def compute_capability_text(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    def describe(self) -> dict[str, str]:
        """Display strings per field (used for ``expected`` / ``got`` in refusals)."""
        return {
            "compute_capability": self.compute_capability_text,
            "gpu_sku": self.gpu_sku,
            "platform": self.platform,
            "tensorrt_version": self.tensorrt_version,
            "precision": self.precision.value,
        }

    def summary(self) -> str:
        return (
            f"GPU cc{self.compute_capability_text} {self.gpu_sku}, platform {self.platform}, "
            f"TensorRT {self.tensorrt_version}, {self.precision.value}"
        )


@dataclass(frozen=True)
class EngineCacheEntry:
    """What a runtime can load: the artifact, the model it came from and how it was built.

    For ``onnx_trt_ep`` the artifact is the ``.onnx`` itself and
    ``staged_engines`` names (at most) one prebuilt engine, gated and loaded
    through an EP-context model.
    """

    runtime_label: str
    artifact_path: Path
    model_path: Path
    model_sha256: str
    build_config: BuildConfig
    staged_engines: tuple[Path, ...] = ()


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output. ``None`` in ``shape`` is a dynamic dimension.

    ``profile``: an input's optimisation profile (the model config's
    ``[[models.profiles]]``, or the engine's own): a request's shape must lie
    within min..max on every axis, and warm-up runs at its opt shape.

    ``shared_dims``: ``(axis, name)`` for each axis whose size the model names
    (ONNX ``dim_param``) with a name it also gives another axis of its inputs or
    outputs: one name is one size, so a request's sizes for it must be equal
    (``bus.codec``).  A name given to one axis alone constrains nothing: not kept."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    profile: OptimizationProfile | None = None
    shared_dims: tuple[tuple[int, str], ...] = ()

    def as_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.profile is not None:
            wire["profile"] = {
                "min_shape": list(self.profile.min_shape),
                "opt_shape": list(self.profile.opt_shape),
                "max_shape": list(self.profile.max_shape),
            }
        return wire

    def warm_up_shape(self) -> tuple[int, ...]:
        """The shape warm-up runs at: the profile's opt shape, else the static shape
        (1 for a dynamic dimension, which only an input without a profile has)."""
        if self.profile is not None:
            return self.profile.opt_shape
        return tuple(1 if dim is None else dim for dim in self.shape)


@dataclass(frozen=True)
class EngineFile:
    """Which file an engine was loaded from: the one the gate validated, by its
    device and inode and its digest.  Its path may name another file later (a
    rebuild or an install there since): this says whether it still is that engine."""

    device: int
    inode: int
    sha256: str


@dataclass(frozen=True, eq=False)
class EngineHandle:
    """A resident engine.  Opaque: the runtime keeps the real object; callers
    see only identity, IO specs and where it runs."""

    handle_id: int
    runtime_label: str
    model_sha256: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    active_providers: tuple[str, ...] = ()
    is_fallback: bool = False
    #: The engine file the ``tensorrt`` runtime deserialized (the one the gate
    #: passed); None for a runtime that loads the model itself.
    engine_path: Path | None = None
    #: Which file that was (``engine_path`` may name another one later); None with it.
    engine_file: EngineFile | None = None
    #: The providers the runtime asked for; None when it has no choice (TensorRT
    #: direct): what it asked for is then what is active.
    requested_providers: tuple[str, ...] | None = None
    #: What the session lacks of what it wanted (``cpu_only``, ``no_tensorrt_ep``,
    #: ``no_cuda_ep``), None when nothing.
    provider_degradation: str | None = None
    #: Why the runtime serves without its engine cache (the TensorRT EP then builds
    #: at every load), None when it has one or needs none.
    engine_cache_error: str | None = None


class HostRegion(Protocol):
    """Host memory a client shares with the daemon (a region of ``inferd.shm``) that
    some of a request's tensors are views of.  A runtime that maps host memory into
    its device (``tensorrt``) registers ``host_array()`` (the whole mapping,
    page-aligned) once, and drops that registration in a hook given to
    ``on_release``: hooks run before the memory is unmapped, never while a request
    uses the region, on whichever thread releases it."""

    def host_array(self) -> np.ndarray: ...

    def on_release(self, hook: Callable[[], None]) -> None: ...


@dataclass(frozen=True)
class DeclaredOperation:
    """A long operation a watched thread declared before starting it (loading and
    warming up an engine): what it is, when it started (``time.monotonic_ns()``)
    and how long it may take.  Within ``allowed_s`` the watchdog vouches for the
    silent thread and says what it waits for; past it, the thread counts as stuck."""

    what: str
    started_ns: int
    allowed_s: float

    def elapsed_s(self, now_ns: int) -> float:
        return (now_ns - self.started_ns) / 1e9

    def overran(self, now_ns: int) -> bool:
        return self.elapsed_s(now_ns) > self.allowed_s


@dataclass(frozen=True)
class Liveness:
    """What the watchdog reads of one watched thread: its last beat
    (``time.monotonic_ns()``, None when the thread is not running) and the long
    operation it declared, if it is in one."""

    beat_ns: int | None
    busy: DeclaredOperation | None = None


@dataclass(frozen=True)
class ThermalState:
    cpu_temp_c: float | None = None
    gpu_temp_c: float | None = None
    thermal_throttle_active: bool = False
    measured_clock_mhz: float | None = None
    measured_at_ns: int = 0
    is_telemetry_available: bool = False

    def __post_init__(self) -> None:
        if not self.is_telemetry_available and self.thermal_throttle_active:
            raise ValueError("throttle cannot be reported active without telemetry")

    @classmethod
    def unavailable(cls, measured_at_ns: int = 0) -> ThermalState:
        return cls(measured_at_ns=measured_at_ns)


AlertLevel = Literal[
    "EMERGENCY", "ALERT", "CRITICAL", "ERROR", "WARNING", "NOTICE", "INFO", "DEBUG"
]


@dataclass(frozen=True)
class Alert:
    level: AlertLevel
    code: str
    message: str
    fields: Mapping[str, Any] = field(default_factory=dict)


#: Components raise alerts through a plain callable; the service decides where
#: they go (PUB ``alert`` topic, log, later the FDR and ground-station hooks).
AlertSink = Callable[[Alert], None]

#: Components publish events (topic, payload) through this; the service owns the PUB socket.
EventSink = Callable[[str, Mapping[str, Any]], None]

#: Components write flight-data-recorder records through this: ``record(kind,
#: payload)``.  It validates the payload against the kind's required keys
#: (raising ``ValueError`` on a programming error) and never blocks.
RecordSink = Callable[[str, Mapping[str, Any]], None]


PeerTransport = Literal["ipc", "tcp", "internal"]

#: The prefix an IPv6 tcp peer is counted by.  A /64 is the block IPv6 gives one
#: host's link (64-bit interface identifiers, RFC 4291 and 7421), in which the
#: host picks its own addresses (temporary ones, RFC 8981, or any a user binds):
#: counted by address, one host would be 2**64 peers, each within every per-peer
#: bound.  A constant, not a config key: a longer prefix splits a host again, a
#: shorter one (the /56 or /48 a site may get) merges separate hosts; and
#: ``Peer.key`` is plain data, rebuilt from ZAP's User-Id wherever a limit reads
#: it, with no config at hand.
IPV6_PEER_PREFIX_BITS = 64
#: ``::ffff:0:0/96``: an IPv4 peer of a dual-stack socket (``getpeername`` and
#: libzmq's ``Peer-Address`` give ``::ffff:127.0.0.2``).
_IPV4_MAPPED = bytes(10) + b"\xff\xff"


def tcp_peer_key(address: str | bytes) -> str:
    """The key a tcp peer is counted and limited by (``bus.max_connections``, the
    descriptor guard's fair shares, the per-peer rate limits): an IPv4 address as
    it is, an IPv4-mapped IPv6 address as that IPv4 address, any other IPv6
    address as its /64 (``2001:db8:1:2::/64``; a zone such as ``%eth0`` dropped).
    ``address``: as text (ZAP's, ``getpeername``'s) or packed (4 or 16 bytes, a
    ``sockaddr``'s); text that is no IP address is its own key."""
    if isinstance(address, str):
        host = address.partition("%")[0]
        try:
            packed = socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        except OSError:
            return address
    else:
        packed = address
    if len(packed) == 4:
        return socket.inet_ntop(socket.AF_INET, packed)
    if packed[:12] == _IPV4_MAPPED:
        return socket.inet_ntop(socket.AF_INET, packed[12:])
    kept = IPV6_PEER_PREFIX_BITS // 8  # whole bytes
    prefix = socket.inet_ntop(socket.AF_INET6, packed[:kept] + bytes(16 - kept))
    return f"{prefix}/{IPV6_PEER_PREFIX_BITS}"


@dataclass(frozen=True)
class Peer:
    """Who sent a request on a socket, as verified when it connected (never what
    the request says): on ``ipc://`` the kernel's SO_PEERCRED of the connecting
    process (uid, gid, pid), on ``tcp://`` the name of its allow-listed CURVE key
    (or only its address without CURVE); ``internal`` for the daemon's own requests
    (a background rebuild).  ``operator``: may change the daemon's state (DESIGN.md 60)."""

    transport: PeerTransport
    uid: int | None = None
    gid: int | None = None
    pid: int | None = None
    #: The login name of ``uid``, when it has one.
    user: str | None = None
    #: The name of the allow-listed CURVE client key it authenticated with.
    curve_key: str | None = None
    #: A tcp peer's IP address.
    address: str | None = None
    operator: bool = False

    @classmethod
    def internal(cls, uid: int, pid: int) -> Peer:
        return cls("internal", uid=uid, pid=pid, operator=True)

    @property
    def key(self) -> str:
        """The principal requests are counted against (rate limits): the uid, the
        CURVE key or, for an anonymous tcp peer, ``tcp_peer_key`` of its address
        (an IPv6 peer's /64)."""
        if self.transport == "internal":
            return "internal"
        if self.curve_key is not None:
            return f"key:{self.curve_key}"
        if self.uid is not None:
            return f"uid:{self.uid}"
        return f"tcp:{self.address if self.address is None else tcp_peer_key(self.address)}"

    def describe(self) -> str:
        """For messages: ``uid 1001 (alice) pid 4242``, ``CURVE key 'ground' from 10.0.0.2``,
        ``an unauthenticated tcp peer at 2001:db8::5 (counted as 2001:db8::/64)``."""
        if self.transport == "internal":
            return f"the daemon itself (pid {self.pid})"
        if self.curve_key is not None:
            return f"CURVE key {self.curve_key!r} from {self.address}"
        if self.uid is not None:
            name = f" ({self.user})" if self.user else ""
            return f"uid {self.uid}{name} pid {self.pid}"
        counted = self.address if self.address is None else tcp_peer_key(self.address)
        shown = "" if counted == self.address else f" (counted as {counted})"
        return f"an unauthenticated tcp peer at {self.address}{shown}"

    def as_record(self) -> dict[str, Any]:
        """The verified identity as FDR records and log lines carry it."""
        return {
            "transport": self.transport,
            "uid": self.uid,
            "gid": self.gid,
            "pid": self.pid,
            "user": self.user,
            "curve_key": self.curve_key,
            "address": self.address,
            "operator": self.operator,
        }
