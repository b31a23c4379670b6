"""TOML configuration -> frozen, validated dataclasses.

Every key is checked at load time: unknown keys, wrong types and out-of-range
values raise ``ConfigError`` naming the key, so a typo never silently falls
back to a default on a vehicle.  ``sections`` holds the dataclasses and their
rules, ``loading`` reads TOML into them.
"""

from inferd.config.loading import embedded_default, from_mapping, load
from inferd.config.metrics import MetricsConfig
from inferd.config.sections import (
    ALERT_HOOKS,
    DEFAULT_MODEL_NAME,
    LOG_FORMATS,
    LOG_LEVELS,
    QUEUE_POLICIES,
    RUNTIME_LABELS,
    THERMAL_SOURCES,
    AlertsConfig,
    BusConfig,
    Config,
    DaemonConfig,
    FdrConfig,
    ModelConfig,
    QueuePolicy,
    RuntimeConfig,
    ShmConfig,
    ThermalConfig,
    default_state_dir,
)
from inferd.config.security import (
    BuildsConfig,
    Principal,
    SecurityConfig,
    SocketAccess,
)

__all__ = [
    "ALERT_HOOKS",
    "DEFAULT_MODEL_NAME",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "QUEUE_POLICIES",
    "RUNTIME_LABELS",
    "THERMAL_SOURCES",
    "AlertsConfig",
    "BuildsConfig",
    "BusConfig",
    "Config",
    "DaemonConfig",
    "FdrConfig",
    "MetricsConfig",
    "ModelConfig",
    "Principal",
    "QueuePolicy",
    "RuntimeConfig",
    "SecurityConfig",
    "ShmConfig",
    "SocketAccess",
    "ThermalConfig",
    "default_state_dir",
    "embedded_default",
    "from_mapping",
    "load",
]
