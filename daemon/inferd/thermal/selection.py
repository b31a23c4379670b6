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


def try_source(
    config: ThermalConfig, name: str, openers: dict[str, SourceOpener] | None = None
) -> SourceSelection:
    """Open the source ``name`` and probe it with one read: the source, or
    (in ``skipped``) why it cannot be used.  Never raises.

    Any failure (library missing, service down, NVML init error, no matching
    zone, a first read that fails or that the monitor would refuse) means
    "try the next source".  The monitor runs it on ``inferd-thermal-open``,
    one source at a time (``opening``)."""
    opener = (OPENERS if openers is None else openers)[name]
    try:
        source = opener(config)
    except TelemetryUnavailableError as exc:
        return SourceSelection(None, ((name, _unprefixed(name, str(exc))),))
    except Exception as exc:
        log.warning("thermal_source_open_crashed", source=name, exc_info=True)
        return SourceSelection(None, ((name, f"{type(exc).__name__}: {exc}"),))
    try:
        problem = implausible(source.read())
    except Exception as exc:
        source.close()
        reason = str(exc) if isinstance(exc, TelemetryUnavailableError) else repr(exc)
        return SourceSelection(None, ((name, f"probe read failed: {_unprefixed(name, reason)}"),))
    if problem is not None:  # the monitor would refuse every read of it
        source.close()
        return SourceSelection(None, ((name, f"probe read failed: {problem}"),))
    return SourceSelection(source)


def _unprefixed(name: str, reason: str) -> str:
    """``reason`` without the ``"<name>: "`` its source's errors start with: every
    reason is shown after its source's name ("jtop: jtop: ..." otherwise)."""
    prefix = f"{name}: "
    return reason[len(prefix) :] if reason.startswith(prefix) else reason


def open_source(
    config: ThermalConfig, openers: dict[str, SourceOpener] | None = None
) -> SourceSelection:
    """Try ``config.sources`` in order (``try_source``): the first that opens
    and probes well, and why each before it was skipped.  Never raises."""
    skipped: list[tuple[str, str]] = []
    for name in config.sources:
        chosen = try_source(config, name, openers)
        if chosen.source is not None:
            return SourceSelection(chosen.source, tuple(skipped))
        skipped.extend(chosen.skipped)
    return SourceSelection(None, tuple(skipped))
