"""Builds the configured hooks, in configured order, refusing those that cannot run."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from inferd.alerts.hooks import FdrAlertHook, PubAlertHook
from inferd.alerts.interface import AlertHook, AlertHookUnavailableError
from inferd.types import EventSink, RecordSink

if TYPE_CHECKING:  # inferd.config pulls in the client package (and pyzmq)
    from inferd.config import AlertsConfig

log = structlog.get_logger("inferd.alerts")


def build_alert_hooks(
    config: AlertsConfig,
    *,
    events: EventSink,
    record: RecordSink | None,
    on_refused: Callable[[str, str], None] | None = None,
) -> list[AlertHook]:
    """One hook per name in ``config.hooks``.

    A hook that cannot be built (``fdr`` without a ``record`` sink, ``mavlink``
    without pymavlink, with an endpoint that cannot be opened or with arguments
    it refuses) is refused:
    logged at ERROR as ``alert_hook_refused``, reported to ``on_refused(hook,
    reason)`` and left out; the others are still returned.
    """
    hooks: list[AlertHook] = []
    for name in config.hooks:
        try:
            hooks.append(_build(name, config, events, record))
        except AlertHookUnavailableError as exc:
            log.error("alert_hook_refused", hook=exc.hook, reason=exc.reason)
            if on_refused is not None:
                on_refused(exc.hook, exc.reason)
    return hooks


def _build(
    name: str, config: AlertsConfig, events: EventSink, record: RecordSink | None
) -> AlertHook:
    if name == "pub":
        return PubAlertHook(events)
    if name == "fdr":
        if record is None:
            raise AlertHookUnavailableError("fdr", "no flight data recorder sink was given")
        return FdrAlertHook(record)
    if name == "mavlink":
        from inferd.alerts.mavlink import MavlinkAlertHook

        try:
            return MavlinkAlertHook(
                config.mavlink_endpoint,
                config.mavlink_source_system,
                config.mavlink_source_component,
            )
        except ValueError as exc:  # ids AlertsConfig refuses first; never a crash at start
            raise AlertHookUnavailableError("mavlink", str(exc)) from None
    raise AlertHookUnavailableError(name, "unknown hook")
