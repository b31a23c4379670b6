"""``inferctl`` whose event subscription is known to have reached the daemon.

Run as ``python -m tests.integration.synced_inferctl ARGS`` (from the
repository root) for a subcommand that follows events, e.g. ``build follow``.
The CLI is the real one; only its ``EventSubscriber`` also subscribes to
``health`` and, before the CLI reads any event, waits for the first health
event (the daemon publishes one every ``daemon.health_interval_s``), then
prints ``subscribed`` on stderr.  A test reads that line instead of sleeping
for ZeroMQ's slow joiner: nothing the daemon publishes afterwards is lost.
Health events are not passed on to the CLI unless it asked for them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import zmq

from inferd_client import EventSubscriber, cli

HEALTH_TOPIC = "health"
SUBSCRIBED = "subscribed"
#: Bounds a hang only: a daemon publishes health events every fraction of a second.
HANG_S = 15.0


class SyncedSubscriber(EventSubscriber):
    def __init__(
        self,
        endpoint: str | None = None,
        *,
        topics: Sequence[str] = (),
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._hide_health = bool(topics) and HEALTH_TOPIC not in topics
        subscribed = (*topics, HEALTH_TOPIC) if self._hide_health else tuple(topics)
        super().__init__(endpoint, topics=subscribed, context=context)
        give_up_at = time.monotonic() + HANG_S
        while True:  # events before the first health event may be partial: dropped
            left = give_up_at - time.monotonic()
            event = super().receive(timeout=left) if left > 0 else None
            if event is None:
                raise SystemExit(f"no health event from {endpoint} within {HANG_S} s")
            if event[0] == HEALTH_TOPIC:
                break
        print(SUBSCRIBED, file=sys.stderr, flush=True)

    def receive(self, timeout: float | None = None) -> tuple[str, dict[str, Any]] | None:
        give_up_at = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if give_up_at is None else max(0.0, give_up_at - time.monotonic())
            event = super().receive(timeout=left)
            if event is None or not (self._hide_health and event[0] == HEALTH_TOPIC):
                return event


if __name__ == "__main__":
    cli.EventSubscriber = SyncedSubscriber  # type: ignore[misc]
    sys.exit(cli.main())
