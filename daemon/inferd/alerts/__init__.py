"""Ground-station alerts: hooks (PUB topic, flight data recorder, MAVLink
STATUSTEXT) behind one rate-limiting ``AlertDispatcher``.

A plain library: no ZeroMQ and nothing from ``inferd.bus`` or
``inferd.service``; the service passes the PUB and FDR sinks in.
``inferd.alerts.mavlink`` imports pymavlink only when a hook is built.
"""

from inferd.alerts.dispatcher import AlertDispatcher
from inferd.alerts.factory import build_alert_hooks
from inferd.alerts.hooks import (
    ALERT_RECORD_KIND,
    ALERT_TOPIC,
    SUPPRESSED_FIELD,
    FdrAlertHook,
    PubAlertHook,
)
from inferd.alerts.interface import AlertHook, AlertHookUnavailableError
from inferd.alerts.levels import LEVELS, log_method, mav_severity

__all__ = [
    "ALERT_RECORD_KIND",
    "ALERT_TOPIC",
    "LEVELS",
    "SUPPRESSED_FIELD",
    "AlertDispatcher",
    "AlertHook",
    "AlertHookUnavailableError",
    "FdrAlertHook",
    "PubAlertHook",
    "build_alert_hooks",
    "log_method",
    "mav_severity",
]
