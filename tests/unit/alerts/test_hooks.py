"""The PUB and FDR alert hooks (``inferd.alerts.hooks``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferd.alerts import FdrAlertHook, PubAlertHook


def test_pub_hook_publishes_the_four_keys() -> None:
    published: list[tuple[str, Mapping[str, Any]]] = []
    hook = PubAlertHook(lambda topic, payload: published.append((topic, payload)))
    hook.alert("ERROR", "model_unavailable", "no runtime", {"model": "demo"})
    hook.alert("ERROR", "model_unavailable", "no runtime", {"model": "demo", "suppressed": 3})
    assert published == [
        (
            "alert",
            {
                "level": "ERROR",
                "code": "model_unavailable",
                "message": "no runtime",
                "fields": {"model": "demo"},
            },
        ),
        (
            "alert",
            {
                "level": "ERROR",
                "code": "model_unavailable",
                "message": "no runtime",
                "fields": {"model": "demo", "suppressed": 3},
            },
        ),
    ]
    assert type(published[0][1]["fields"]) is dict  # msgpack cannot pack a mappingproxy


def test_fdr_hook_records_c7_alert_with_suppressed_as_its_own_key() -> None:
    records: list[tuple[str, Mapping[str, Any]]] = []
    hook = FdrAlertHook(lambda kind, payload: records.append((kind, payload)))
    hook.alert("WARNING", "cpu_fallback", "on CPU", {"model": "demo", "suppressed": 2})
    hook.alert("INFO", "note", "plain", {})
    assert records == [
        (
            "alert",
            {
                "level": "WARNING",
                "code": "cpu_fallback",
                "message": "on CPU",
                "fields": {"model": "demo"},
                "suppressed": 2,
            },
        ),
        (
            "alert",
            {"level": "INFO", "code": "note", "message": "plain", "fields": {}, "suppressed": 0},
        ),
    ]
    assert set(records[0][1]) == {"level", "code", "message", "fields", "suppressed"}
