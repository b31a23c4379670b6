"""The environment of a process the daemon starts: its own, less what makes a
process speak to systemd for the unit.

systemd gives the main process ``$NOTIFY_SOCKET`` (sd_notify) and, with
``WatchdogSec=``, ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID``.  A child inherits them
unless told otherwise (sd_notify(3) and sd_watchdog_enabled(3) offer
``unset_environment`` for this).  The daemon cannot unset them in its own
environment: systemd-python's ``notify`` reads ``$NOTIFY_SOCKET`` on every call
(``notify.Notifier``).  So each child's environment is built without them: a
build child, or anything it loads (a TensorRT plugin, a library linked against
libsystemd), can never send ``READY=1``, ``STOPPING=1`` or ``WATCHDOG=1`` for the
daemon.  Under ``NotifyAccess=main`` systemd would drop such a datagram with a
warning in the journal; under ``NotifyAccess=all`` (a drop-in) a child's ping
would keep a wedged daemon alive.  ``$JOURNAL_STREAM`` stays: a child that writes
to the daemon's stderr writes to the same journal stream.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: What systemd sets for the main process alone (sd_notify(3), sd_watchdog_enabled(3)).
SUPERVISOR_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def child_environment(
    extra: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``environ`` (this process's by default) without ``SUPERVISOR_VARIABLES``,
    with ``extra`` added."""
    source = os.environ if environ is None else environ
    env = {key: value for key, value in source.items() if key not in SUPERVISOR_VARIABLES}
    env.update(extra or {})
    return env
