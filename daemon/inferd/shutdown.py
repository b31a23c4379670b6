"""The steps of the daemon's stop (``Daemon.stop``, and what a failed start-up
releases), each run whatever the ones before it did.

A component whose stop raises must not leave the rest running: the sockets of
the threads after it open (so the ZeroMQ context cannot be terminated), the
requests still queued unanswered, the recorder's queue unwritten, the instance
lock held.  Each step is run through ``StopSteps``, which logs an exception
(``daemon_stop_step_failed``, with the step's name and the traceback) and goes on.

A stop must also end in the time the daemon asks systemd for (``STOPPING=1`` with
``EXTEND_TIMEOUT_USEC``), or systemd kills it, perhaps before the recorder's last
flush.  That time is the sum of ``stop_budget.stop_bounds``, the most each step that
waits may wait, and ``StopSteps`` gives each such step no more than that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import zmq

from inferd.bus.internal_errors import internal_message
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd_wire.protocol import Code

log = structlog.get_logger("inferd.daemon")


class StopSteps:
    """Runs the steps of a stop; ``failed`` names those that raised.

    ``bounds`` (``stop_budget.stop_bounds``) gives the stop one deadline, their sum from now.
    A step that waits (``waiting``) may wait its bound, and never into the time owed
    to the steps after it: when those before it took longer than theirs (a component
    that overran the time it was given, a step that cannot be given one), it gets
    what is left.  So the stop ends by the deadline whatever hangs, and each later
    step, the recorder's flush last, still gets its whole bound."""

    def __init__(self, bounds: Mapping[str, float]) -> None:
        self.failed: list[str] = []
        self._bounds = dict(bounds)
        self._deadline = time.monotonic() + sum(self._bounds.values())

    def __call__(self, name: str, step: Callable[..., object], *args: Any) -> None:
        try:
            step(*args)
        except Exception as exc:
            self.failed.append(name)
            log.exception(
                "daemon_stop_step_failed", step=name, error=f"{type(exc).__name__}: {exc}"
            )

    def waiting(self, name: str, step: Callable[..., object], *args: Any) -> None:
        """Run ``step(*args, wait_s)``, ``wait_s`` being what it may wait now."""
        self(name, step, *args, self.wait_s(name))

    def wait_s(self, name: str) -> float:
        """What step ``name`` may wait now: its bound, less what it would take from
        the bounds of the steps after it."""
        names = list(self._bounds)
        owed_later = sum(self._bounds[later] for later in names[names.index(name) + 1 :])
        left = self._deadline - time.monotonic() - owed_later
        return max(0.0, min(self._bounds[name], left))


def drain(scheduler: Scheduler, router: RequestRouter, drain_s: float) -> None:
    """Wait up to ``drain_s`` for the queues to empty, close the scheduler (the
    engine worker takes nothing more) and answer what is left ``UNAVAILABLE``."""
    drained = scheduler.wait_idle(drain_s)
    leftovers = scheduler.close()
    if leftovers:
        log.warning("requests_failed_at_shutdown", count=len(leftovers), drained=drained)
    router.fail(leftovers, Code.UNAVAILABLE, "the daemon shut down before this request ran")


def answer_after_worker_death(
    router: RequestRouter, scheduler: Scheduler, exc: BaseException, in_hand: Job | None
) -> int:
    """Answer what a dead engine worker leaves (nothing runs again): the request it
    was answering ``INTERNAL`` and every queued one ``UNAVAILABLE``; how many were
    queued.  The exception's text stays in the log, which the worker wrote
    (``engine_worker_died``, once in a process's life; ``bus.internal_errors``)."""
    stopped = f"the engine worker stopped ({type(exc).__name__})"
    if in_hand is not None:
        what = f"{stopped} while answering this request"
        router.fail([in_hand], Code.INTERNAL, internal_message(what, "engine_worker_died"))
    leftovers = scheduler.close()
    router.fail(leftovers, Code.UNAVAILABLE, f"{stopped}; inferd restarts")
    return len(leftovers)


def joined(thread: threading.Thread, timeout: float) -> None:
    """``thread.join(timeout)``, or nothing for a thread never started (start-up
    failed before it)."""
    if thread.ident is not None:
        thread.join(timeout)


def terminate(context: zmq.Context[Any], alive: Mapping[str, bool]) -> None:
    """Terminate ``context`` unless a thread that holds one of its sockets is still
    ``alive``: ``zmq_ctx_term`` would then wait for that socket forever.  Once they
    all ended, a socket one of them left open (it died between creating the socket
    and the ``finally`` that closes it) is closed here, at once, for the same reason:
    no thread uses it any more."""
    if any(alive.values()):
        log.error("threads_did_not_stop", **alive)
    else:
        context.destroy(linger=0)
