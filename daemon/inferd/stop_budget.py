"""The stop's budget: the most each step of ``Daemon.stop`` that waits may wait,
in the order the stop runs them (``stop_bounds``).  ``StopSteps`` (``shutdown.py``)
holds each step to its bound and the whole stop to their sum, which the daemon
asks systemd for (``STOPPING=1`` with ``EXTEND_TIMEOUT_USEC``): one table for
both, so that the time asked for is the time the stop can take."""

from __future__ import annotations

from inferd.alerts.tcp_link import CONNECT_TIMEOUT_S
from inferd.config import DaemonConfig

#: How long the stop waits for a component's threads to end once told to: long
#: for one that is busy (a reply being sent, a scrape answered, a model running),
#: and a bound on one that hangs.
THREAD_END_S = 10.0
#: After the builds' cancel grace (their children then killed): for their records.
BUILD_RECORD_S = 10.0
#: The switches' or failovers' threads, which may be inside a runtime's native code.
PREPARERS_S = 10.0
#: The thermal poller and the reading it waits for, which may hang in a sensor.
THERMAL_S = 5.0
#: The recorder's last flush: what is queued written and fdatasync'd.
RECORDER_FLUSH_S = 10.0


def stop_bounds(config: DaemonConfig) -> dict[str, float]:
    """The most each step of ``Daemon.stop`` that waits may wait (s), in the order
    the stop runs them: their sum is the stop's budget (``Daemon.stop_budget_s``)."""
    return {
        # Cancelled together, each child killed the grace after: one bound for all.
        "builds.shutdown": config.build_cancel_grace_s + BUILD_RECORD_S,
        "scheduler.drain": config.shutdown_drain_ms / 1000,
        "switcher.stop": PREPARERS_S,
        "failover.stop": PREPARERS_S,
        "worker.join": THREAD_END_S,
        "bus.join": THREAD_END_S,
        "shm.stop": THREAD_END_S,  # its closer ends within it (shm/server.py)
        "thermal.stop": THERMAL_S,
        "metrics.stop": THREAD_END_S,
        # Not cut short (no timeout reaches a hook): a tcp: MAVLink link waits for
        # its connecting thread, its connect timeout and 1 s (alerts/tcp_link.py).
        "alerts.close": CONNECT_TIMEOUT_S + 1.0,
        "publisher.join": THREAD_END_S,
        "security.stop": THREAD_END_S,  # the descriptor guard, then the ZAP handler
        "recorder.stop": RECORDER_FLUSH_S,  # last: each step before leaves it its time
    }
