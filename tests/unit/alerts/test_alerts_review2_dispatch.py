"""The second alert review's dispatcher findings (F3, F4, a nit).

F3: a ``fields`` that cannot be read at the top level raised out of the
sanitiser's quick check: the alert reached no hook though counted sent, and in
``close()`` it stopped every later held-back repeat and left the hooks open.
F4: a hook whose own ``status()`` raised failed the daemon's whole ``status``
and every metrics scrape.  Nit: a key that is no string, whose ``repr`` is
``suppressed``, came back into ``fields`` after sanitising."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher, sanitise
from inferd.alerts import dispatcher as dispatcher_module
from inferd.config import MetricsConfig
from inferd.metrics.exporter import MetricsExporter
from inferd.types import Alert
from tests.integration.test_schemas import assert_valid
from tests.unit.alerts.conftest import FakeClock, RecordingHook
from tests.unit.alerts.test_alerts_sanitised_once import Unreadable
from tests.unit.alerts.test_mavlink_held_alerts import HOOK_STATUS

UNREADABLE_REASON = "fields cannot be read: RuntimeError('cannot be read')"


class ReadOnce(Mapping[str, Any]):
    """A ``fields`` that can be iterated once (a generator behind it)."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = items
        self.reads = 0

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        self.reads += 1
        if self.reads > 1:
            raise RuntimeError("read twice")
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_an_alert_whose_top_level_fields_cannot_be_read_is_delivered_empty() -> None:
    hook = RecordingHook("mavlink")
    dispatcher = AlertDispatcher([hook])
    dispatcher(Alert("ERROR", "bad", "first", Unreadable()))
    # Before: sanitised() raised, the hook got nothing, the alert was counted sent.
    marker = {"reason": UNREADABLE_REASON, "changed": ["fields"]}
    assert hook.calls == [("ERROR", "bad", "first", {"sanitised": marker})]
    assert dispatcher.status()["hooks"]["mavlink"]["sent"] == 1


def test_close_delivers_every_held_back_repeat_and_closes_the_hooks() -> None:
    """The review's r1: an unreadable repeat held back before a good one."""
    hook = RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=60.0)
    dispatcher(Alert("ERROR", "bad", "first", Unreadable()))
    dispatcher(Alert("ERROR", "bad", "repeat", Unreadable()))  # held back
    dispatcher(Alert("ERROR", "good", "first", {"model": "m"}))
    dispatcher(Alert("ERROR", "good", "repeat", {"model": "m"}))  # held back
    dispatcher.close()  # before: raised RuntimeError, the hook not closed
    assert [(code, message) for _level, code, message, _fields in hook.calls] == [
        ("bad", "first"),
        ("good", "first"),
        ("bad", "repeat"),
        ("good", "repeat"),
    ]
    assert hook.closed
    assert dispatcher.status()["sent"] == 4


@pytest.mark.parametrize("how", ["close", "flush"])
def test_a_held_back_repeat_that_cannot_be_delivered_loses_no_other(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever makes one delivery fail (a bug), the other repeats are delivered
    and ``close()`` still closes the hooks."""

    def failing(code: str, message: str, fields: Mapping[str, Any]) -> Any:
        if code == "bad":
            raise RuntimeError("a bug")
        return sanitise.sanitised(code, message, fields)

    clock = FakeClock()
    hook = RecordingHook()
    dispatcher = AlertDispatcher([hook], rate_limit_s=10.0, clock=clock)
    for code in ("bad", "good"):
        dispatcher(Alert("ERROR", code, "first", {}))
    monkeypatch.setattr(dispatcher_module, "sanitised", failing)
    for code in ("bad", "good"):
        dispatcher(Alert("ERROR", code, "repeat", {}))  # held back
    clock.now += 10.0
    with capture_logs() as logs:
        if how == "close":
            dispatcher.close()  # before: raised, the hook not closed
        else:
            assert dispatcher.flush() == 2  # before: raised
    assert ("good", "repeat") in [(code, message) for _l, code, message, _f in hook.calls]
    assert hook.closed == (how == "close")
    failed = [entry for entry in logs if entry["event"] == "alert_dispatch_failed"]
    assert [entry["alert_code"] for entry in failed] == ["bad"]


def test_fields_that_are_no_dict_are_read_once() -> None:
    """What hooks get is a dict the sanitiser built, not the raiser's mapping read
    again (before: the quick check read it, then ``_deliver``'s ``dict()``)."""
    hook = RecordingHook()
    fields = ReadOnce({"model": "m", "count": 3})
    AlertDispatcher([hook])(Alert("ERROR", "note", "once", fields))
    assert [call[3] for call in hook.calls] == [{"model": "m", "count": 3}]  # before: []
    assert fields.reads == 1


class StatusHook(RecordingHook):
    """A hook with a link status that raises once ``broken`` is set."""

    def __init__(self) -> None:
        super().__init__("mavlink")
        self.broken: Exception | None = None

    def status(self) -> dict[str, Any]:
        if self.broken is not None:
            raise self.broken
        return {
            "state": "no_peer",
            "destinations": 0,
            "error": None,
            "ignored": 2,
            "waiting": 1,
            "held": 3,
            "replayed": 2,
            "expired": 0,
            "overflowed": 0,
            "dropped_at_close": 0,
        }


def test_a_hook_whose_status_raises_is_shown_unknown_and_logged_once() -> None:
    hook = StatusHook()
    dispatcher = AlertDispatcher([hook])
    hook.broken = OSError("link status unreadable")
    with capture_logs() as logs:
        first = dispatcher.status()  # before: raised OSError
        dispatcher.status()
    error = "its status cannot be read: OSError('link status unreadable')"
    entry = first["hooks"]["mavlink"]
    assert entry["link"] == {**dispatcher_module._LINK_UNREAD, "error": error}
    assert_valid(HOOK_STATUS, entry)
    assert [(e["event"], e["error"]) for e in logs] == [("alert_hook_status_failed", error)]
    # Read once, then failing: the counts as last read, the state unknown.
    hook.broken = None
    assert dispatcher.status()["hooks"]["mavlink"]["link"]["state"] == "no_peer"
    hook.broken = OSError("again")
    with capture_logs() as logs:
        link = dispatcher.status()["hooks"]["mavlink"]["link"]
    assert (link["state"], link["held"], link["ignored"]) == ("unknown", 3, 2)
    assert link["error"] == "its status cannot be read: OSError('again')"
    assert [e["event"] for e in logs] == ["alert_hook_status_failed"]  # a new failure


def test_a_metrics_scrape_survives_a_hook_whose_status_raises() -> None:
    """The review's r9: the exporter builds every section from one ``status``."""
    hook = StatusHook()
    hook.broken = OSError("link status unreadable")
    dispatcher = AlertDispatcher([hook])

    class Source:
        slots: dict[str, Any] = {}

        def status(self, _hints: Any) -> dict[str, Any]:
            return {"alerts": dispatcher.status()}

    exporter = MetricsExporter(MetricsConfig(), Source())
    names = {metric.name for metric in exporter.collect()}  # before: raised OSError
    assert any(name.startswith("inferd_alert") for name in names), names


def test_a_key_that_reads_as_suppressed_once_sanitised_is_dropped() -> None:
    """A raiser's own ``suppressed`` is dropped (``_normalised``); so is a key
    that is no string whose ``repr`` is ``suppressed`` (before: it came back,
    and the MAVLink hook sent "(+7 repeats)")."""

    class Key:
        def __repr__(self) -> str:
            return "suppressed"

    hook = RecordingHook()
    AlertDispatcher([hook])(Alert("ERROR", "note", "key", {Key(): 7, "model": "m"}))  # type: ignore[dict-item]
    ((_level, _code, _message, fields),) = hook.calls
    assert fields == {
        "model": "m",
        "sanitised": {"reason": sanitise.NOT_STR_KEY, "changed": ["fields"]},
    }
