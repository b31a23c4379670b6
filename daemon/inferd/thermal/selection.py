"""Open the first source that works, in the configured order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from inferd.config import ThermalConfig
from inferd.errors import TelemetryUnavailableError
from inferd.thermal.reading import ThermalSource, implausible

log = structlog.get_logger("inferd.thermal")

SourceOpener = Callable[[ThermalConfig], ThermalSource]


def _open_jtop(config: ThermalConfig) -> ThermalSource:
    from inferd.thermal.jtop_source import open_jtop

    return open_jtop(config)


def _open_nvml(config: ThermalConfig) -> ThermalSource:
    from inferd.thermal.nvml_source import open_nvml

    return open_nvml(config)


def _open_sysfs(config: ThermalConfig) -> ThermalSource:
    from inferd.thermal.sysfs_source import open_sysfs

    return open_sysfs(config)


#: Source name (as in ``thermal.sources``) → opener.  An opener raises
#: ``TelemetryUnavailableError`` when its source cannot be used here.
OPENERS: dict[str, SourceOpener] = {
    "jtop": _open_jtop,
    "nvml": _open_nvml,
    "sysfs": _open_sysfs,
}


@dataclass(frozen=True)
class SourceSelection:
    """The opened source (``None``: telemetry unavailable) and why each source
    before it was skipped, in the order tried."""

    source: ThermalSource | None
    skipped: tuple[tuple[str, str], ...] = ()


def open_source(
    config: ThermalConfig,
    openers: dict[str, SourceOpener] | None = None,
    *,
    trying: Callable[[str], None] | None = None,
) -> SourceSelection:
    """Try ``config.sources`` in order: open, then probe with one read.

    Any failure (library missing, service down, NVML init error, no matching
    zone, a first read that fails) means "try the next source".  Never raises.
    ``trying`` is told each source's name before it is opened (the monitor
    names the one whose open hangs).
    """
    openers = OPENERS if openers is None else openers
    skipped: list[tuple[str, str]] = []
    for name in config.sources:
        if trying is not None:
            trying(name)
        try:
            source = openers[name](config)
        except TelemetryUnavailableError as exc:
            skipped.append((name, str(exc)))
            continue
        except Exception as exc:
            log.warning("thermal_source_open_crashed", source=name, exc_info=True)
            skipped.append((name, f"{type(exc).__name__}: {exc}"))
            continue
        try:
            problem = implausible(source.read())
        except Exception as exc:
            source.close()
            reason = str(exc) if isinstance(exc, TelemetryUnavailableError) else repr(exc)
            skipped.append((name, f"probe read failed: {reason}"))
            continue
        if problem is not None:  # the monitor would refuse every read of it
            source.close()
            skipped.append((name, f"probe read failed: {problem}"))
            continue
        return SourceSelection(source, tuple(skipped))
    return SourceSelection(None, tuple(skipped))
