"""Operator runtime switching, make-before-break.

The new runtime is prepared (engine deserialised and warmed up) on a switch
thread while the current one keeps serving; the swap itself runs on the
engine worker between two requests, and the old engine is released there
right after.  If preparing fails nothing changes and the operator is told why.

Every switch is a ``runtime_switch`` FDR record, but a refusal repeated (an
operator's script in a loop) would push the flight's history out of the
recorder's size cap: the first refusal of a model for a reason is recorded, and
those after it within ``REFUSAL_WINDOW_S`` are counted by a ``RepeatLimiter``
and recorded as one ``runtime_switch_refusals`` record when the window ends (the
daemon's housekeeping), before the next one recorded, or at ``stop``.  The
operator's reply is the same either way.

Each switch prepares a runtime (an engine loaded, an ONNX Runtime session built),
and a preparation that fails writes its own records and alerts (``engine_refused``,
``provider_degraded``): so ``runtime.switch`` is rate limited per verified peer
(``runtime.switch_burst``, ``runtime.switch_refill_s``), as ``build.start`` is.  A
token is taken only by a switch that is about to prepare (its arguments, model and
the model's state checked, no switch of it in progress); one refused by the limit
changes nothing and is logged and counted (``status.security.switch_limit``), not
recorded.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import structlog

from inferd.config import RUNTIME_LABELS, RuntimeConfig
from inferd.errors import InferdError, RuntimeNotAvailableError
from inferd.peer_rate_limit import PeerRateLimiter
from inferd.repeat_limiter import RepeatLimiter
from inferd.serving.handover import Handover, Preparers
from inferd.serving.scheduler import Scheduler, SchedulerClosedError
from inferd.serving.slot import ModelSlot, Sinks
from inferd.types import EngineHandle, Peer
from inferd_wire.protocol import MAX_REQUESTED_BY_CHARS, Code, ProtocolError, require_text

log = structlog.get_logger("inferd.switch")

Respond = Callable[[dict[str, Any] | ProtocolError], None]

#: How long a prepared engine may wait for the worker to take it.
_SWAP_TIMEOUT_S = 60.0
#: How long ``stop`` waits for the switches' threads to end unless told (the daemon's
#: stop passes its own bound, ``inferd.shutdown.stop_bounds``): a preparation still
#: loading an engine when the interpreter exits can crash it (SIGSEGV, SIGABRT).
_STOP_WAIT_S = 10.0
#: How long refusals of a model for one reason are counted, not recorded, after one
#: is recorded (as alerts' ``rate_limit_s`` and the log repeat limiter's window).
REFUSAL_WINDOW_S = 10.0
REFUSALS_KIND = "runtime_switch_refusals"


class OperatorsChoiceError(ProtocolError):
    """``switch_now`` refused: the model serves the engine an operator switched it to,
    which the daemon's own switch (a rebuilt engine adopted) does not override."""


class ModelClaimedError(ProtocolError):
    """Refused: a switch or a failover of the model is in progress (it is claimed)."""


class NotPreparedError(ProtocolError):
    """Refused: the runtime could not be prepared; ``cause`` is the type name of what
    ``ModelSlot.prepare`` raised (as ``ModelSlot.fallback_cause``: ``BUILD_FIXES``)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(Code.FAILED_PRECONDITION, message)
        self.cause = cause


class SwitchWatcher(Protocol):
    """Told of the switcher's changes to a model (``FallbackRebuilder``)."""

    def released(self, model: str) -> None:
        """``model`` is no longer claimed (the releasing thread; must not block)."""

    def operator_chose(self, model: str) -> None:
        """An operator's switch made ``model`` serve their choice (still claimed)."""


class _Switch(Handover):
    """One operator's switch in progress: its swap's handover, and its reply, given
    once (by the switch, or by ``stop`` for it)."""

    def __init__(self, respond: Respond) -> None:
        super().__init__()
        self._respond = respond
        self._answered = False

    def answer(self, reply: dict[str, Any] | ProtocolError) -> None:
        with self._lock:
            if self._answered:
                return
            self._answered = True
        self._respond(reply)


class RuntimeSwitcher:
    def __init__(
        self,
        slots: Mapping[str, ModelSlot],
        scheduler: Scheduler,
        runtime_config: RuntimeConfig,
        sinks: Sinks,
        ready: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``ready``: whether the engine worker takes swaps (it loads every model
        first: a swap queued before would wait out ``_SWAP_TIMEOUT_S``); ``clock``:
        what the windows of repeated refusals and the peers' rates are timed by."""
        self._ready = ready
        self._slots = slots
        self._scheduler = scheduler
        self._runtime_config = runtime_config
        self._sinks = sinks
        self._lock = threading.Lock()
        self._in_progress: set[str] = set()
        #: The engine each model was last switched to by an operator (``switch_now``
        #: leaves a model serving it alone), set while the model is claimed.
        self._chosen: dict[str, EngineHandle] = {}
        self._watchers: list[SwitchWatcher] = []
        #: Switches preparing (``stop`` answers them and waits for them).
        self._preparers: Preparers[_Switch] = Preparers()
        self._refusals = RepeatLimiter(burst=1, window_s=REFUSAL_WINDOW_S, clock=clock)
        self.rate = PeerRateLimiter(
            "runtime.switch",
            runtime_config.switch_burst,
            runtime_config.switch_refill_s,
            keys="runtime.switch_burst, runtime.switch_refill_s",
            clock=clock,
        )

    def switch(self, header: dict[str, Any], peer: Peer, respond: Respond) -> None:
        """Control op ``runtime.switch {model, runtime, requested_by?}`` (bus thread) of
        the operator ``peer``: its verified identity goes into the record next to the
        ``requested_by`` it claims.

        Refusals that need no preparation raise ProtocolError at once; otherwise
        the reply comes through ``respond`` when the switch is done or refused.
        """
        model, label = header.get("model"), header.get("runtime")
        requested_by = header.get("requested_by", "operator")
        if not isinstance(model, str) or not isinstance(label, str):
            raise ProtocolError(Code.INVALID_ARGUMENT, "'model' and 'runtime' must be strings")
        # Recorded as sent (FDR, journal): printable only, before anything is taken.
        requested_by = require_text(requested_by, "requested_by", MAX_REQUESTED_BY_CHARS)
        slot = self._slots.get(model)
        if slot is None:
            raise ProtocolError(
                Code.NOT_FOUND, f"no model named {model!r}; served: {sorted(self._slots)}"
            )
        if label not in RUNTIME_LABELS:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"unknown runtime {label!r}; known: {list(RUNTIME_LABELS)}",
            )
        if not self._ready():
            raise ProtocolError(
                Code.UNAVAILABLE,
                "the daemon is still loading its models and swaps no engine until it has "
                "loaded them all; switch once inferctl health says serving or degraded",
            )
        if slot.state != "serving" or slot.handle is None:
            raise ProtocolError(
                Code.FAILED_PRECONDITION,
                f"model {model!r} is {slot.state}; switch it once it serves",
            )
        switch = _Switch(respond)
        thread = threading.Thread(
            target=self._run,
            args=(slot, label, requested_by, peer, switch),
            name=f"inferd-switch-{model}",
            daemon=True,
        )
        self._claim_or_refuse(model)
        try:
            self._take_from_rate(model, peer)  # last: a switch refused above cost nothing
        except ProtocolError:
            self.unclaim(model)
            raise
        try:
            started = self._preparers.start(thread, switch)
        except BaseException:  # its thread could not start (the thread limit)
            self._not_started(model, peer)
            raise
        if not started:
            self._not_started(model, peer)
            raise ProtocolError(Code.UNAVAILABLE, "the daemon is shutting down")

    def stop(self, wait_s: float = _STOP_WAIT_S) -> None:
        """At shutdown, once the worker takes no more calls: every operator's switch
        whose swap the worker has not taken is given up and told UNAVAILABLE now (a
        prepared engine is released by its switch), so no operator is left without
        a reply when the sockets close; then each switch's thread is waited for, up
        to ``wait_s`` in all, so that none is inside a runtime's native code
        when the process exits.  Last, the refusals still counted are recorded."""
        refusal = ProtocolError(
            Code.UNAVAILABLE, "the daemon is shutting down; the runtime was not switched"
        )
        if not self._preparers.stop(wait_s, lambda switch: switch.answer(refusal)):
            log.warning("runtime_switch_still_preparing", waited_s=wait_s)
        self.flush_refusals(ended_only=False)  # before the recorder stops

    def flush_refusals(self, *, ended_only: bool = True) -> None:
        """Record the refusals counted in windows that have ended (the daemon's
        housekeeping), or in every window (``stop``)."""
        for (_, model, reason), count in self._refusals.flush(ended_only=ended_only):
            self._record_refusals(model, reason, count)

    def switch_now(self, model: str, label: str, requested_by: str) -> dict[str, Any]:
        """The same make-before-break switch, asked for inside the daemon (a background
        build was adopted): prepares on the calling thread and returns the reply
        ``runtime.switch`` would give; ``ProtocolError`` when refused (nothing changes),
        ``ModelClaimedError`` while a switch or failover of the model is in progress.

        A model that serves the engine an operator switched it to (``runtime.switch``
        since the build was asked for: ``onnx_trt_ep`` on purpose, or an engine of their
        own) keeps it: ``OperatorsChoiceError``, checked once the model is claimed, so no
        switch or failover changes it between the check and the swap.  A failover or
        another switch since replaces that engine, and the rule with it."""
        slot = self._slots[model]
        # Claimed first: a failover in progress (the model ``loading``) is then
        # ``ModelClaimedError``, which the rebuilder retries once it is released.
        self._claim_or_refuse(model)
        switch = _Switch(lambda reply: None)
        try:
            if slot.state != "serving" or slot.handle is None:
                raise ProtocolError(
                    Code.FAILED_PRECONDITION, f"model {model!r} is {slot.state}; not switched"
                )
            chosen = slot.handle
            if chosen is not None and chosen is self._chosen.get(model):
                raise OperatorsChoiceError(
                    Code.FAILED_PRECONDITION,
                    f"model {model!r} serves on {chosen.runtime_label}, where an operator "
                    "switched it; not switched",
                )
            # ``stop`` gives it up and waits for it like an operator's.
            if not self._preparers.enter(switch):
                raise ProtocolError(Code.UNAVAILABLE, "the daemon is shutting down")
            peer = Peer.internal(os.getuid(), os.getpid())
            return self._switch(slot, label, requested_by, peer, switch)
        finally:
            self._preparers.leave()
            self.unclaim(model)

    def claim(self, model: str) -> bool:
        """Make ``model`` the caller's to change (a switch, or a failover while serving:
        ``serving/failover.py``); False while someone else changes it."""
        with self._lock:
            if model in self._in_progress:
                return False
            self._in_progress.add(model)
            return True

    def unclaim(self, model: str) -> None:
        with self._lock:
            self._in_progress.discard(model)
        for watcher in self._watchers:
            watcher.released(model)

    def claimed(self, model: str) -> bool:
        with self._lock:
            return model in self._in_progress

    def watch(self, watcher: SwitchWatcher) -> None:
        """Tell ``watcher`` of every release and operator's choice from now on."""
        self._watchers.append(watcher)

    def _take_from_rate(self, model: str, peer: Peer) -> None:
        """Take one of ``peer``'s switches, or RESOURCE_EXHAUSTED saying when to retry
        (nothing taken, nothing changed).  The daemon's own are not counted."""
        if peer.transport == "internal":
            return
        wait_s = self.rate.retry_after(peer.key)
        if wait_s is not None:
            log.warning(
                "runtime_switch_rate_limited",
                model=model,
                peer=peer.as_record(),
                retry_after_s=wait_s,
            )
            raise self.rate.refusal(peer, wait_s)
        self.rate.take(peer.key)

    def _not_started(self, model: str, peer: Peer) -> None:
        """The switch ``_take_from_rate`` counted did not start: its thread did not."""
        self.unclaim(model)
        if peer.transport != "internal":
            self.rate.give_back(peer.key)

    def _claim_or_refuse(self, model: str) -> None:
        if not self.claim(model):
            raise ModelClaimedError(
                Code.FAILED_PRECONDITION, f"a switch of model {model!r} is already in progress"
            )

    def _run(
        self, slot: ModelSlot, label: str, requested_by: str, peer: Peer, switch: _Switch
    ) -> None:
        try:
            reply = self._switch(slot, label, requested_by, peer, switch)
            if slot.handle is not None:  # still claimed: the engine this switch made serve
                self._chosen[slot.name] = slot.handle
                for watcher in self._watchers:
                    watcher.operator_chose(slot.name)
            switch.answer(reply)
        except ProtocolError as exc:
            switch.answer(exc)
        except Exception as exc:  # never leave the operator without an answer
            log.exception("runtime_switch_crashed", model=slot.name)
            switch.answer(ProtocolError(Code.INTERNAL, f"switch failed unexpectedly: {exc}"))
        finally:
            self.unclaim(slot.name)
            self._preparers.leave()

    def _switch(
        self, slot: ModelSlot, label: str, requested_by: str, peer: Peer, switch: _Switch
    ) -> dict[str, Any]:
        who = (requested_by, peer)
        current = slot.handle
        from_label = current.runtime_label if current is not None else None
        started = time.monotonic()
        log.info(
            "runtime_switch_preparing",
            model=slot.name,
            from_runtime=from_label,
            to_runtime=label,
            requested_by=requested_by,
        )
        sinks = slot.sinks_for_model(self._sinks)
        try:
            runtime, handle = slot.prepare(label, self._runtime_config, sinks)
        except (RuntimeNotAvailableError, InferdError) as exc:
            reason = f"cannot prepare {label}: {exc}; {from_label} keeps serving"
            self._report(slot, from_label, label, who, "refused", reason, started)
            raise NotPreparedError(reason, type(exc).__name__) from None
        prepared = time.monotonic()
        swap_s: list[float] = []

        def swap() -> None:  # runs on the engine worker, between two requests
            if not switch.take():
                return  # given up: the switch released the engine and said so
            began = time.monotonic()
            try:
                old_runtime, old_handle = slot.swap(runtime, handle)
                swap_s.append(time.monotonic() - began)
            finally:
                switch.settled.set()
            if old_runtime is not None and old_handle is not None:
                old_runtime.release_engine(old_handle)

        def not_switched(outcome: str, reason: str, code: Code) -> ProtocolError:
            runtime.release_engine(handle)
            reason = f"{reason}; {from_label} keeps serving"
            self._report(slot, from_label, label, who, outcome, reason, started)
            return ProtocolError(code, reason)

        if switch.queue():  # else given up by ``stop``
            try:
                self._scheduler.call_on_worker(swap)
            except SchedulerClosedError:
                switch.give_up()
        outcome = switch.wait(_SWAP_TIMEOUT_S)
        if outcome == "not_taken":
            waited = f"the engine worker did not take the new engine within {_SWAP_TIMEOUT_S} s"
            raise not_switched("failed", waited, Code.INTERNAL)
        if outcome == "given_up":  # shutting down: by ``stop``, or the scheduler closed
            raise not_switched("refused", "the daemon is shutting down", Code.UNAVAILABLE)
        if outcome == "stuck" or not swap_s:
            raise ProtocolError(Code.INTERNAL, "the engine worker failed to swap the engines")
        timings = {
            "prepare_ms": round((prepared - started) * 1000, 3),
            "swap_ms": round(swap_s[0] * 1000, 3),
        }
        self._report(slot, from_label, label, who, "switched", None, started, timings)
        self._sinks.events("runtime", slot.describe_runtime())
        return {
            "model": slot.name,
            "from_runtime": from_label,
            "to_runtime": label,
            "active_providers": list(_providers(slot.handle)),
            **timings,
        }

    def _report(
        self,
        slot: ModelSlot,
        from_label: str | None,
        to_label: str,
        who: tuple[str, Peer],
        outcome: str,
        reason: str | None,
        started: float,
        timings: Mapping[str, float] | None = None,
    ) -> None:
        payload = {
            "model": slot.name,
            "from_runtime": from_label,
            "to_runtime": to_label,
            # What the client claims, next to who the daemon verified it is.
            "requested_by": who[0],
            "peer": who[1].as_record(),
            "outcome": outcome,
            "reason": reason,
            "elapsed_ms": round((time.monotonic() - started) * 1000, 3),
            **(timings or {}),
        }
        method = log.info if outcome == "switched" else log.warning
        method("runtime_switch", **payload)
        if outcome == "refused":
            held_back = self._refusals.admit(("runtime_switch", slot.name, str(reason)))
            if held_back is None:
                return  # counted: recorded with the others when its window ends
            self._record_refusals(slot.name, str(reason), held_back)
        self._sinks.record("runtime_switch", payload)

    def _record_refusals(self, model: str, reason: str, count: int) -> None:
        if count > 0:
            self._sinks.record(
                REFUSALS_KIND,
                {"model": model, "reason": reason, "count": count, "window_s": REFUSAL_WINDOW_S},
            )


def _providers(handle: EngineHandle | None) -> tuple[str, ...]:
    return handle.active_providers if handle is not None else ()
