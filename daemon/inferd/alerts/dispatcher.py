"""Fans alerts out to the hooks, with per-(code, model) rate limiting.

Rate limit: the first alert of a key ``(code, fields["model"])`` goes out and
opens a window of ``rate_limit_s``; repeats inside the window are held back
and counted; the first one after the window goes out carrying the count
(``fields["suppressed"]``, present only when > 0) and opens a new window.
``flush()`` sends the last held-back repeat of each key whose window has
passed, so a burst that stops is still reported; ``close()`` does so for every
key.  Every raised alert is thus either delivered or counted in one that is:
``raised == sent + suppressed + dropped_after_close`` in ``status()``.
``close()`` waits (``close_wait_s`` at most) for the deliveries in progress on
other threads before it closes the hooks, so an alert counted as sent is not
handed to a closed hook (DESIGN.md 261).

Sanitising: every hook and the ``alert`` log line get the same alert, one that
each can send whole: ``_sanitised`` escapes what UTF-8 cannot hold, cuts long
strings (the message to 4096 bytes of UTF-8), bounds ``fields`` and turns what
msgpack cannot pack into its ``repr`` (``alerts.sanitise``), once per delivery
(not for a repeat held back: a storm of them pays only the rate limit), and adds
``fields["sanitised"]`` (``{reason, changed}``) when it changed anything; the
FDR record keeps that marker, the PUB event leaves it out.  An alert that needs
no change is not copied.

Logging: each delivered alert is logged once at its level (EMERGENCY, ALERT,
CRITICAL -> critical; ERROR -> error; WARNING -> warning; NOTICE, INFO ->
info; DEBUG -> debug) as ``alert`` with ``alert_level``, ``alert_code``,
``alert_message``, ``alert_fields`` (and ``model``, the alert's own, when it
names one); a held-back repeat is logged at debug as
``alert_suppressed`` (a repeating fault must not flood the journal either);
an alert raised after ``close()`` is logged at its level with ``delivered=False``.

Isolation: a hook that raises is counted and logged at ERROR at most once per
window per hook; the caller and the other hooks never notice.  No lock is held
while hooks run, so a hook may itself raise an alert.  A hook's own ``status()``
(the MAVLink link's), read for every ``status`` request and metrics scrape, is
isolated too: one that raises is shown as its link's ``state: unknown`` with the
error (the counts as last read) and logged once (``alert_hook_status_failed``),
never failing the reply or the scrape.  It must not block, as ``alert()`` must
not: it is not bounded here (a thread per read would cost more than the hooks'
own reads, which take their lock only around non-blocking sends).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from types import MappingProxyType
from typing import Any

import structlog

from inferd.alerts.hooks import SANITISED_FIELD, SUPPRESSED_FIELD
from inferd.alerts.interface import AlertHook
from inferd.alerts.levels import LEVELS, log_method
from inferd.alerts.sanitise import bounded_repr, sanitised
from inferd.types import Alert

log = structlog.get_logger("inferd.alerts")

_Key = tuple[str, Hashable]
_RESERVED = frozenset((SUPPRESSED_FIELD, SANITISED_FIELD))

#: A hook's ``link`` (``status_reply.json``) when its ``status()`` raised before
#: any read succeeded: nothing known, the error in ``error``.
_LINK_UNREAD: dict[str, Any] = {
    "state": "unknown",
    "destinations": 0,
    "error": None,
    "ignored": 0,
    "waiting": 0,
    "held": 0,
    "replayed": 0,
    "expired": 0,
    "overflowed": 0,
    "dropped_at_close": 0,
}

#: Longest wait in ``close()`` for deliveries in progress (a hook must not block:
#: each takes microseconds; one past this is handed to a closed hook, which fails it).
CLOSE_WAIT_S = 1.0


@dataclasses.dataclass
class _Window:
    opened_at: float
    #: Repeats held back since the last delivery of this key.
    pending: int = 0
    #: The newest held-back repeat: what ``flush`` sends.
    last: Alert | None = None


@dataclasses.dataclass
class _HookState:
    name: str
    hook: AlertHook
    sent: int = 0
    failures: int = 0
    last_error: str | None = None
    error_logged_at: float | None = None
    failures_since_log: int = 0
    #: The hook's ``status()`` as last read, and why the last read failed (logged once).
    link: dict[str, Any] | None = None
    status_error: str | None = None


class AlertDispatcher:
    """An ``AlertSink`` (``dispatcher(alert)``) that never raises."""

    def __init__(
        self,
        hooks: Sequence[AlertHook],
        *,
        rate_limit_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        close_wait_s: float = CLOSE_WAIT_S,
    ) -> None:
        if rate_limit_s < 0:
            raise ValueError(f"rate_limit_s must be zero or positive, got {rate_limit_s}")
        self.rate_limit_s = rate_limit_s
        self.close_wait_s = close_wait_s
        self._clock = clock
        self._lock = threading.Lock()
        #: Notified when the last delivery in progress ends (``_in_flight`` falls to 0).
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._windows: dict[_Key, _Window] = {}
        self._hooks: list[_HookState] = []
        names: set[str] = set()
        for hook in hooks:
            base = str(getattr(hook, "name", type(hook).__name__))
            name, index = base, 2
            while name in names:
                name, index = f"{base}#{index}", index + 1
            names.add(name)
            self._hooks.append(_HookState(name, hook))
        self._raised = 0
        self._sent = 0
        self._suppressed = 0
        self._dropped = 0
        self._closed = False

    @property
    def hook_names(self) -> tuple[str, ...]:
        return tuple(state.name for state in self._hooks)

    # -- AlertSink ----------------------------------------------------------
    def __call__(self, alert: Alert) -> None:
        try:
            self._dispatch(alert)
        except Exception:  # never break the component that raised the alert
            log.exception("alert_dispatch_failed", alert_code=getattr(alert, "code", None))

    def _dispatch(self, alert: Alert) -> None:
        alert = _normalised(alert)
        key = _key(alert)
        now = self._clock()
        with self._lock:
            self._raised += 1
            if self._closed:
                self._dropped += 1
                closed, deliver, suppressed = True, False, 0
            else:
                closed = False
                window = self._windows.get(key)
                if window is not None and now - window.opened_at < self.rate_limit_s:
                    window.pending += 1
                    window.last = alert
                    self._suppressed += 1
                    deliver, suppressed = False, window.pending
                else:
                    suppressed = window.pending if window is not None else 0
                    self._windows[key] = _Window(opened_at=now)
                    self._sent += 1
                    self._in_flight += 1  # in the same section: close() waits for it
                    deliver = True
        if deliver:
            try:
                self._deliver(alert, suppressed)
            finally:
                self._delivered()
        elif closed:
            alert = _sanitised(alert)
            _log_alert(alert, dict(alert.fields), delivered=False)
        else:
            log.debug(
                "alert_suppressed",
                alert_code=alert.code,
                alert_level=alert.level,
                model=key[1],
                pending=suppressed,
            )

    # -- maintenance --------------------------------------------------------
    def flush(self) -> int:
        """Send the newest held-back repeat of every key whose window has
        passed (with the count of the others); returns how many were sent.
        Call it periodically (e.g. on the health tick)."""
        return self._flush(force=False)

    def close(self) -> None:
        """Flush every held-back repeat regardless of its window, wait for the
        deliveries in progress on other threads (``close_wait_s`` at most), then
        close the hooks.  Later alerts, and those raised while the flush is being
        delivered, are logged but not delivered (``dropped_after_close``)."""
        with self._lock:
            if self._closed:
                return
            due = self._take_due(self._clock(), force=True)
            # Closed in the same critical section as the last flush: an alert
            # raised while these are delivered is dropped and counted, not held
            # back in a window that nothing will ever flush.
            self._closed = True
        self._deliver_each(due)
        with self._lock:
            self._idle.wait_for(lambda: self._in_flight == 0, self.close_wait_s)
            in_flight = self._in_flight
        if in_flight:  # a hook that blocks; what it then hands a closed hook fails there
            log.warning(
                "alert_close_wait_exceeded", in_flight=in_flight, close_wait_s=self.close_wait_s
            )
        for state in self._hooks:
            try:
                state.hook.close()
            except Exception as exc:
                log.error("alert_hook_close_failed", hook=state.name, error=repr(exc))

    def _flush(self, *, force: bool) -> int:
        now = self._clock()
        with self._lock:
            if self._closed:
                return 0
            due = self._take_due(now, force=force)
            self._in_flight += 1
        try:
            self._deliver_each(due)
        finally:
            self._delivered()
        return len(due)

    def _deliver_each(self, due: list[tuple[Alert, int]]) -> None:
        """Deliver held-back repeats, each on its own: one that fails (a bug) is
        logged, and neither the others nor what follows (``close()`` closing the
        hooks) is lost with it."""
        for alert, suppressed in due:
            try:
                self._deliver(alert, suppressed)
            except Exception:
                log.exception("alert_dispatch_failed", alert_code=getattr(alert, "code", None))

    def _delivered(self) -> None:
        """One delivery (or flush) counted in ``_in_flight`` has ended."""
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def _take_due(self, now: float, *, force: bool) -> list[tuple[Alert, int]]:
        """The held-back repeats to send now, counted as sent; call with the lock held."""
        due: list[tuple[Alert, int]] = []
        for key, window in self._windows.items():
            if window.last is None:
                continue
            if force or now - window.opened_at >= self.rate_limit_s:
                due.append((window.last, window.pending - 1))
                self._windows[key] = _Window(opened_at=now)
                self._sent += 1
                self._suppressed -= 1
        # A key quiet for a whole window needs no state.
        for key in [
            key
            for key, window in self._windows.items()
            if window.last is None and now - window.opened_at >= self.rate_limit_s
        ]:
            del self._windows[key]
        return due

    def status(self) -> dict[str, Any]:
        # A hook's own link state (the MAVLink hook's ``status()``), read outside the
        # dispatcher's lock: the hook takes its own, held briefly.
        links = {
            state.name: {"link": self._link(state, read)}
            for state in self._hooks
            if callable(read := getattr(state.hook, "status", None))
        }
        with self._lock:
            return {
                "raised": self._raised,
                "sent": self._sent,
                "suppressed": self._suppressed,
                "dropped_after_close": self._dropped,
                "pending": sum(window.pending for window in self._windows.values()),
                "rate_limit_s": self.rate_limit_s,
                "closed": self._closed,
                "hooks": {
                    state.name: {
                        "sent": state.sent,
                        "failures": state.failures,
                        "last_error": state.last_error,
                        **links.get(state.name, {}),
                    }
                    for state in self._hooks
                },
            }

    def _link(self, state: _HookState, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``read()`` (a hook's ``status()``); when it raises, the last read (or
        nothing read yet) with ``state: unknown`` and the error, logged once."""
        try:
            link = read()
        except Exception as exc:
            error = f"its status cannot be read: {bounded_repr(exc)}"
            with self._lock:
                first, state.status_error = state.status_error != error, error
                last = state.link if state.link is not None else _LINK_UNREAD
            if first:
                log.error("alert_hook_status_failed", hook=state.name, error=error, exc_info=exc)
            return {**last, "state": "unknown", "error": error}
        with self._lock:
            state.link, state.status_error = link, None
        return link

    # -- delivery -----------------------------------------------------------
    def _deliver(self, alert: Alert, suppressed: int) -> None:
        alert = _sanitised(alert)
        fields: dict[str, Any] = dict(alert.fields)
        if suppressed > 0:
            fields[SUPPRESSED_FIELD] = suppressed
        _log_alert(alert, fields, delivered=True)
        view = MappingProxyType(fields)
        for state in self._hooks:
            try:
                state.hook.alert(alert.level, alert.code, alert.message, view)
            except Exception as exc:
                self._hook_failed(state, alert, exc)
            else:
                with self._lock:
                    state.sent += 1

    def _hook_failed(self, state: _HookState, alert: Alert, exc: Exception) -> None:
        now = self._clock()
        with self._lock:
            state.failures += 1
            state.failures_since_log += 1
            state.last_error = repr(exc)
            if (
                self.rate_limit_s > 0
                and state.error_logged_at is not None
                and now - state.error_logged_at < self.rate_limit_s
            ):
                return
            state.error_logged_at = now
            failures, state.failures_since_log = state.failures_since_log, 0
        log.error(
            "alert_hook_failed",
            hook=state.name,
            alert_code=alert.code,
            error=repr(exc),
            failures_since_last_log=failures,
            failures_total=state.failures,
            exc_info=exc,
        )


def _log_alert(alert: Alert, fields: dict[str, Any], *, delivered: bool) -> None:
    extra: dict[str, Any] = {} if delivered else {"delivered": False}
    if "model" in fields:
        # Top level, over a model bound in the thread's contextvars: the log's
        # repeat limiter keys on it, so one code's alerts for many models are
        # each logged (they are rate-limited per (code, model) here already).
        extra["model"] = fields["model"]
    getattr(log, log_method(alert.level))(
        "alert",
        alert_level=alert.level,
        alert_code=alert.code,
        alert_message=alert.message,
        alert_fields=fields,
        **extra,
    )


def _key(alert: Alert) -> _Key:
    try:
        model: Hashable = alert.fields.get("model")
    except Exception:  # fields that cannot be read: sanitising says so
        model = None
    try:
        hash(model)
    except TypeError:
        model = bounded_repr(model)
    return (alert.code, model)


def _normalised(alert: Alert) -> Alert:
    """Unknown levels become ERROR (the alert is not lost); a raiser's own
    ``suppressed`` and ``sanitised`` fields are dropped (the keys are the
    dispatcher's)."""
    changes: dict[str, Any] = {}
    if alert.level not in LEVELS:
        log.error("alert_invalid_level", alert_code=alert.code, alert_level=alert.level)
        changes["level"] = "ERROR"
    try:
        if SUPPRESSED_FIELD in alert.fields or SANITISED_FIELD in alert.fields:
            changes["fields"] = {k: v for k, v in alert.fields.items() if k not in _RESERVED}
    except Exception:  # fields that cannot be read: sanitising leaves them empty
        pass
    return dataclasses.replace(alert, **changes) if changes else alert


def _sanitised(alert: Alert) -> Alert:
    """The alert every hook and the log line get (``sanitise.sanitised``), with
    ``fields["sanitised"]`` saying what changed and why; the alert itself, not
    copied, when it needs no change."""
    clean = sanitised(alert.code, alert.message, alert.fields)
    if clean is None:
        return alert
    fields, changed = clean.fields, clean.changed
    # A key that was no string and reads as a reserved one once sanitised (its
    # ``repr``): left out, as a raiser's own ``suppressed`` is (``_normalised``).
    if reserved := _RESERVED.intersection(fields):
        fields = {key: value for key, value in fields.items() if key not in reserved}
        changed = [name for name in changed if name.removeprefix("fields.") not in reserved]
        changed += [] if "fields" in changed else ["fields"]  # values left out
    if changed:  # not when only a mapping that is no dict was copied
        fields = {**fields, SANITISED_FIELD: {"reason": clean.reason, "changed": changed}}
    return dataclasses.replace(alert, code=clean.code, message=clean.message, fields=fields)
