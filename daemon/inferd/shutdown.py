"""The steps of the daemon's stop (``Daemon.stop``, and what a failed start-up
releases), each run whatever the ones before it did.

A component whose stop raises must not leave the rest running: the sockets of
the threads after it open (so the ZeroMQ context cannot be terminated), the
requests still queued unanswered, the recorder's queue unwritten, the instance
lock held.  Each step is run through ``StopSteps``, which logs an exception
(``daemon_stop_step_failed``, with the step's name and the traceback) and goes on.
"""

from __future__ import annotations

import threading
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
    """Runs the steps of a stop; ``failed`` names those that raised."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, name: str, step: Callable[..., object], *args: Any) -> None:
        try:
            step(*args)
        except Exception as exc:
            self.failed.append(name)
            log.exception(
                "daemon_stop_step_failed", step=name, error=f"{type(exc).__name__}: {exc}"
            )


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
