"""A sanitised alert's size is bounded in bytes (the second alert review's F6).

The limits counted characters: an alert of 4-byte characters packed to 213 KiB
(its PUB event 179 KiB, over the 64 KiB the Python and C++ subscribers take, so
they ended the connection), not the ~45 KiB the comment said.  They are bytes
of UTF-8 now, and ``sanitise.MAX_PACKED_BYTES`` is measured here."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import pytest
from structlog.testing import capture_logs

from inferd.alerts import AlertDispatcher, FdrAlertHook, PubAlertHook, sanitise
from inferd.types import Alert
from inferd_client.events import MAX_EVENT_BYTES
from inferd_wire import protocol

#: The length of each string as raised: 6 digits in every cut's note.
RAISED_CHARS = 100_000
#: What the docs (OPERATIONS.md "Alerts", the publisher's comment) give for the event.
PUB_EVENT_BYTES = 50 * 1024


def _worst(char: str) -> Alert:
    """Every limit reached: the code, the message, 64 top-level fields each with
    a long key and value (each named in ``changed``), more left out."""
    fields: dict[Any, Any] = {
        f"{index:03d}" + char * RAISED_CHARS: char * RAISED_CHARS for index in range(70)
    }
    return Alert("EMERGENCY", char * RAISED_CHARS, char * (10 * RAISED_CHARS), fields)


@pytest.mark.parametrize(
    "char", ["a", "é", "€", "\U0001f600", "\udce9"], ids=["1", "2", "3", "4", "surrogate"]
)
def test_the_worst_alert_packs_within_its_bound(char: str) -> None:
    records: list[Mapping[str, Any]] = []
    events: list[Mapping[str, Any]] = []
    dispatcher = AlertDispatcher(
        [
            FdrAlertHook(lambda _kind, payload: records.append(payload)),
            PubAlertHook(lambda _topic, payload: events.append(payload)),
        ],
        rate_limit_s=60.0,
    )
    with capture_logs():  # the alert line, kept out of a failure's report
        for _ in range(3):  # the last goes out at close() with ``suppressed``
            dispatcher(_worst(char))
        dispatcher.close()
    assert [record["suppressed"] for record in records] == [0, 1]
    record_bytes = max(len(msgpack.packb(record, use_bin_type=True)) for record in records)
    # As the publisher sends it (``EventPublisher._send``).
    event_bytes = max(
        len(protocol.pack({**event, "ts_ns": 1 << 62, "seq": 1 << 40})) for event in events
    )
    sizes = f"record {record_bytes} B, event {event_bytes} B"
    assert record_bytes <= sanitise.MAX_PACKED_BYTES, sizes  # before: 218 KiB (4-byte)
    assert event_bytes <= PUB_EVENT_BYTES, sizes
    assert event_bytes <= MAX_EVENT_BYTES, sizes  # what a subscriber takes; before: 183 KiB
    assert record_bytes > sanitise.MAX_PACKED_BYTES - 4096  # the bound is near the worst


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("é" * 300, "é" * 256),  # 2 bytes each: 256 in 512 bytes
        ("€" * 200, "€" * 170),  # 3 bytes: 170 whole ones, the 171st would be cut in half
        ("\U0001f600" * 200, "\U0001f600" * 128),
        ("a" + "\U0001f600" * 128, "a" + "\U0001f600" * 127),
    ],
)
def test_a_string_is_cut_to_its_limit_in_bytes_at_a_whole_character(text: str, kept: str) -> None:
    clean = sanitise.sanitised("c", "m", {"value": text})
    assert clean is not None
    assert clean.fields["value"] == f"{kept} [cut: {len(text)} characters]"
    assert clean.reason == sanitise.TOO_LONG


def test_a_string_within_its_limit_in_bytes_is_not_copied() -> None:
    alert = {"value": "\U0001f600" * 128, "key" + "é" * 62: 1}  # 512 and 127 bytes
    assert sanitise.sanitised("c" * 128, "€" * 1365, alert) is None


def test_the_reason_names_a_surrogate_where_it_is_kept_and_every_cut() -> None:
    """The reason: "a lone surrogate" when one is in what is kept, not when the
    cut dropped it; "over its limit" whenever the text was cut (before: not when
    only its escape made it too long)."""
    dropped = sanitise.sanitised("c", "m", {"value": "a" * 600 + "\udce9"})
    kept = sanitise.sanitised("c", "m", {"value": "a" * 509 + "\udce9"})  # cut mid-escape
    assert dropped is not None and kept is not None
    assert dropped.reason == sanitise.TOO_LONG
    assert kept.reason == f"{sanitise.SURROGATE}; {sanitise.TOO_LONG}"
    assert kept.fields["value"] == "a" * 509 + "\\ud [cut: 510 characters]"


def test_nan_and_infinities_are_kept_as_floats() -> None:
    """Decided, not fixed: msgpack packs them, and the project's JSON writers
    (``inferctl --json``, ``inferd fdr dump --json``, MCAP, the C++ client) show
    them as null; a string would change a field's type for every consumer."""
    fields = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
    assert sanitise.sanitised("c", "m", fields) is None
