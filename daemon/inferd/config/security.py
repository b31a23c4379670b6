"""Who may use which socket, and the limits on daemon builds (``[security]``, ``[builds]``).

Names in the config (users, groups) are resolved here, at load, so a typo or a
group missing on this host stops the daemon with the key that names it instead of
silently admitting nobody (or everybody).  CURVE key names (``key:NAME``) are
checked at start, against the keys in ``security.curve_clients_dir``.
"""

from __future__ import annotations

import grp
import ipaddress
import pwd
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from inferd.config.ceilings import MAX_BUILD_DURATION_S, MAX_DISK_BYTES
from inferd.config.checks import between, op_rate
from inferd.config.refusals import every_rule, refuse
from inferd.errors import ConfigError

PrincipalKind = Literal["user", "group", "key"]
SOCKETS: tuple[str, ...] = ("infer", "control", "events")
#: A CURVE client key's name: its file name in ``curve_clients_dir`` without ``.key``
#: (``\Z``, not ``$``: ``$`` matches before a final newline, and ``key:ops\n`` passed).
KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_LOOPBACK_HOSTS = ("localhost",)


@dataclass(frozen=True)
class Principal:
    """One entry of an allow-list: a user (uid), a group (gid) or a CURVE key (name)."""

    kind: PrincipalKind
    #: uid, gid or key name.
    ident: int | str
    #: As written in the config (``group:inferd-ops``), for messages.
    text: str


@dataclass(frozen=True)
class SocketAccess:
    """One socket's access: the group its ipc:// socket file gets (None: the daemon's
    own group, unchanged) and who may connect (empty: whoever the transport admits,
    i.e. the file's mode on ipc://, an allow-listed CURVE key on tcp://)."""

    group: int | None = None
    group_name: str | None = None
    allow: tuple[Principal, ...] = ()


@dataclass(frozen=True)
class SecurityConfig:
    infer: SocketAccess = field(default_factory=SocketAccess)
    control: SocketAccess = field(default_factory=SocketAccess)
    events: SocketAccess = field(default_factory=SocketAccess)
    #: Who may run the control ops that change state; root and the daemon's own
    #: user always may (DESIGN.md 60).
    operators: tuple[Principal, ...] = ()
    #: CURVE on every tcp:// endpoint (required for a non-loopback address).
    curve: bool = False
    curve_secret_key: Path = Path("keys/server.key_secret")
    curve_clients_dir: Path = Path("keys/clients")

    def access(self, socket: str) -> SocketAccess:
        access: SocketAccess = getattr(self, socket)
        return access

    @every_rule
    def __post_init__(self) -> None:
        if self.curve:
            return
        for where, principals in self._principal_lists():
            for index, principal in enumerate(principals):
                if principal.kind == "key":
                    refuse(
                        f"{where}[{index}]: {principal.text!r} names a CURVE key, but "
                        "security.curve is false",
                        f"{where}[{index}]",
                    )

    def _principal_lists(self) -> list[tuple[str, tuple[Principal, ...]]]:
        lists = [(f"security.{name}_allow", self.access(name).allow) for name in SOCKETS]
        return [*lists, ("security.operators", self.operators)]

    def key_names(self) -> list[tuple[str, str]]:
        """Every ``key:NAME`` principal as ``(config key, NAME)``."""
        return [
            (f"{where}[{index}]", str(principal.ident))
            for where, principals in self._principal_lists()
            for index, principal in enumerate(principals)
            if principal.kind == "key"
        ]


#: ``builds.max_duration_s``'s default.  TensorRT builds on a Jetson take minutes
#: for detection models and can take hours for large ones (optimization level 5, a
#: cold timing cache); a build still running after 4 h is taken as stuck (a
#: deployment with slower builds raises it; not measured on a Jetson here).
DEFAULT_MAX_BUILD_DURATION_S = 4 * 3600.0
#: ``builds.max_running``'s default: one operator's build beside one background
#: rebuild, so that neither holds the other up for a build's minutes.  Each build is
#: a child process with its own memory and, with TensorRT, its own builder and a
#: workspace of at most a quarter of ``runtime.gpu_memory_budget_bytes``; on a
#: Jetson, whose GPU shares the board's memory, two are what 8 GB holds beside the
#: resident engines (a deployment short of memory, or wanting tactics timed on an
#: otherwise idle GPU, sets 1: builds, the daemon's own rebuilds included, then run
#: one after another).
DEFAULT_MAX_RUNNING_BUILDS = 2
#: ``builds.max_running``'s ceiling: one build per model runs at most anyway, and no
#: board runs more than a few builders at once.
MAX_RUNNING_BUILDS = 64
#: ``builds.stall_after_s``'s default: TensorRT 10's progress monitor reports a step
#: every few milliseconds to seconds, but timing the tactics of one large layer can
#: take tens of seconds without one (not measured on a Jetson here), so two minutes
#: of silence is a stall worth a line in the log, not a slow layer.
DEFAULT_STALL_AFTER_S = 120.0
#: ``builds.stall_after_s``'s floor (0 aside, which turns the watchdog off): the
#: build child's watchdog wakes four times per period (at most every 50 ms), so a
#: nanosecond spun a CPU beside the builder.
MIN_STALL_AFTER_S = 0.1
#: ``builds.stall_cancels_after``'s ceiling: at the watchdog's largest back-off (300 s
#: between reports) a thousand stalls in a row are more than three days of silence.
MAX_STALL_CANCELS_AFTER = 1000
#: What ``builds.stall_after_s`` and ``build.start``'s ``stall_after_s`` may be.
STALL_AFTER_RULE = (
    f"0 (no stall watchdog) or {MIN_STALL_AFTER_S:g}..{MAX_BUILD_DURATION_S:g} seconds"
)


def stall_after_ok(seconds: float) -> bool:
    """Whether ``seconds`` is a stall watchdog's period (``STALL_AFTER_RULE``); NaN and
    inf fail every comparison: neither could reach the watchdog's waits."""
    return seconds == 0 or MIN_STALL_AFTER_S <= seconds <= MAX_BUILD_DURATION_S


@dataclass(frozen=True)
class BuildsConfig:
    """Daemon builds (``[builds]``): the cap on what they leave (``<state_dir>/builds``
    and TensorRT builds' outputs in the engine dir, counted together), the
    per-peer rate of ``build.start``, how long one build may run and how many run at
    once."""

    #: Build artifact sets (engine, sidecar, summary) kept in both directories.
    max_count: int = 8
    #: Bytes the builds' artifact sets may hold in both directories.
    max_bytes: int = 2 * 1024**3
    #: ``build.start`` a peer may send at once ...
    start_burst: int = 3
    #: ... and then one more every this many seconds.
    start_refill_s: float = 20.0
    #: A build still running this long after its start is cancelled (source
    #: ``timeout``), and killed if it has not stopped ``build_cancel_grace_s`` later.
    max_duration_s: float = DEFAULT_MAX_BUILD_DURATION_S
    #: Builds running at once, the daemon's own rebuilds included: a ``build.start``
    #: past it is refused ``RESOURCE_EXHAUSTED``; a rebuild waits for a build to end.
    max_running: int = DEFAULT_MAX_RUNNING_BUILDS
    #: A build child that reports no progress for this long reports a stall (a
    #: ``stalled`` event, ``engine_build_stalled`` in the log), again with back-off;
    #: 0: no watchdog.  ``build.start``'s ``stall_after_s`` sets it for one build.
    stall_after_s: float = DEFAULT_STALL_AFTER_S
    #: This many stalls in a row (no progress between) cancel the build, source
    #: ``stall``; 0: stalls are only reported.
    stall_cancels_after: int = 0

    @every_rule
    def __post_init__(self) -> None:
        if not 1 <= self.max_count <= 10_000:
            key = "builds.max_count"
            refuse(f"{key} must be 1..10000, got {self.max_count}", key)
        between("builds.max_bytes", self.max_bytes, 1024**2, MAX_DISK_BYTES)  # 1 MiB at least
        op_rate("builds", "start", self.start_burst, self.start_refill_s)
        # NaN and inf fail the comparison too: neither could reach a wait
        if not 0.0 < self.max_duration_s <= MAX_BUILD_DURATION_S:
            refuse(
                f"builds.max_duration_s must be in (0, {MAX_BUILD_DURATION_S:g}] seconds, "
                f"got {self.max_duration_s}",
                "builds.max_duration_s",
            )
        if not 1 <= self.max_running <= MAX_RUNNING_BUILDS:
            key = "builds.max_running"
            refuse(f"{key} must be 1..{MAX_RUNNING_BUILDS}, got {self.max_running}", key)
        if not stall_after_ok(self.stall_after_s):
            key = "builds.stall_after_s"
            refuse(f"{key} must be {STALL_AFTER_RULE}, got {self.stall_after_s}", key)
        if not 0 <= self.stall_cancels_after <= MAX_STALL_CANCELS_AFTER:
            key = "builds.stall_cancels_after"
            limit = MAX_STALL_CANCELS_AFTER
            refuse(f"{key} must be 0..{limit} (0: never), got {self.stall_cancels_after}", key)


#: The largest uid or gid: ``uid_t`` and ``gid_t`` are 32 bits, and their -1 tells
#: ``chown`` to leave the group as it is.
MAX_ID = 2**32 - 2


def _number(key: str, name: str) -> int | None:
    """``name`` as a uid or gid when it is one written in ASCII digits, else None (a
    name): ``'²'.isdigit()`` holds but ``int`` refuses it, and ``int('٣')`` is 3."""
    if not (name.isascii() and name.isdigit()):
        return None
    if len(name) > len(str(MAX_ID)) or int(name) > MAX_ID:  # int() refuses 4,301 digits
        raise ConfigError(f"{key}: {name} is no uid or gid (0..{MAX_ID})")
    return int(name)


def resolve_group(key: str, name: str) -> int:
    """A group name (or a number) as its gid; ``ConfigError`` naming ``key``."""
    number = _number(key, name)
    if number is not None:
        return number
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(
            f"{key}: no group named {name!r} on this host (create it: groupadd --system {name})"
        ) from None


def resolve_user(key: str, name: str) -> int:
    number = _number(key, name)
    if number is not None:
        return number
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise ConfigError(f"{key}: no user named {name!r} on this host") from None


def parse_principal(key: str, text: str) -> Principal:
    """``user:NAME|UID``, ``group:NAME|GID`` or ``key:NAME``."""
    kind, _, name = text.partition(":")
    if kind == "user" and name:
        return Principal("user", resolve_user(key, name), text)
    if kind == "group" and name:
        return Principal("group", resolve_group(key, name), text)
    if kind == "key" and KEY_NAME.match(name):
        return Principal("key", name, text)
    raise ConfigError(
        f"{key}: {text!r} must be 'user:NAME', 'group:NAME' (a uid or gid number works too) "
        "or 'key:NAME' (a CURVE client key in security.curve_clients_dir: letters, digits, "
        "'_', '.', '-')"
    )


def tcp_host(endpoint: str) -> str | None:
    """The host part of a ``tcp://`` endpoint (``*`` for every interface), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    address = endpoint.removeprefix("tcp://")
    host = address.rsplit(":", 1)[0] if ":" in address else address
    # [::1] for IPv6; a bound endpoint has no ``source;`` part (``checks.endpoint``)
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches only this machine; an interface name, ``*``
    or a host name other than ``localhost`` is assumed not to."""
    if host in _LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
