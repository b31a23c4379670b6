"""structlog event -> journald fields: MESSAGE, PRIORITY, MESSAGE_ID and the
searchable ``INFERD_*`` fields (see ``journal_fields``).  Pure mapping: no
sockets, no structlog configuration."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from inferd_wire.printable import printable, printable_lines

SYSLOG_IDENTIFIER = "inferd"
#: MESSAGE_ID = uuid5(this namespace, INFERD_EVENT): stable per event type across
#: releases and hosts, so ``journalctl MESSAGE_ID=...`` finds one kind of event.
MESSAGE_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:inferd:journal:event")

#: syslog priorities (journald ``PRIORITY=``) by structlog level name.
PRIORITIES = {
    "critical": 2,
    "exception": 3,
    "error": 3,
    "warning": 4,
    "warn": 4,
    "info": 6,
    "debug": 7,
}

#: Event keys with a fixed journal field (``code`` and ``alert_code`` both give INFERD_CODE).
NAMED_FIELDS = {
    "model": "INFERD_MODEL",
    "runtime": "INFERD_RUNTIME",
    "build_id": "INFERD_BUILD_ID",
    "code": "INFERD_CODE",
    "alert_code": "INFERD_CODE",
}
#: Keys an alert carries inside ``alert_fields`` that are lifted to top-level fields.
_LIFTED_FROM_ALERT = ("model", "runtime", "build_id")
#: Keys consumed by the renderer itself rather than sent as INFERD_* fields.
_CONSUMED = frozenset(
    {"event", "level", "timestamp", "exception", "stack", "pathname", "lineno", "func_name"}
)
_CODE_FIELDS = (("pathname", "CODE_FILE"), ("lineno", "CODE_LINE"), ("func_name", "CODE_FUNC"))
_INVALID_FIELD_CHARS = re.compile(r"[^A-Z0-9_]")
#: journald's field-name rule (journal_field_valid): 1..64 of A-Z, 0-9, '_', not
#: starting with a digit; a leading '_' is reserved for fields journald sets.
MAX_FIELD_NAME = 64


def message_id(event: str) -> str:
    """MESSAGE_ID for an event type: 32 lowercase hex digits (sd-id128 format)."""
    return uuid.uuid5(MESSAGE_ID_NAMESPACE, event).hex


def field_name(key: str) -> str:
    """``INFERD_<KEY>`` upper-cased and sanitised to journald's field-name rules."""
    name = "INFERD_" + _INVALID_FIELD_CHARS.sub("_", key.upper())
    return name[:MAX_FIELD_NAME]


def field_value(value: Any) -> bytes | None:
    """A journal field value; None for a value not worth a field (``None``)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, str):
        return value.encode("utf-8", "replace")
    if isinstance(value, (int, float, PurePath)):
        return str(value).encode()
    if isinstance(value, (Mapping, list, tuple, set, frozenset)):
        if isinstance(value, (set, frozenset)):
            value = sorted(value, key=str)
        return json.dumps(value, default=str, separators=(",", ":")).encode("utf-8", "replace")
    return str(value).encode("utf-8", "replace")


def _message_value(value: Any) -> str:
    # A word as it is; anything else (a space, any character that is not printable:
    # every other whitespace is one) quoted by ``repr``, which escapes them.
    if isinstance(value, str):
        return value if value and value.isprintable() and " " not in value else repr(value)
    rendered = field_value(value)
    return printable(rendered.decode("utf-8", "replace")) if rendered is not None else "None"


def render_message(event_dict: Mapping[str, Any]) -> str:
    """MESSAGE: the event name, then ``key=value`` pairs, then any traceback.  The
    human line, so nothing in it is a terminal control: ``journalctl -a`` and
    ``-o cat`` write it as it is (``journalctl`` alone shows a message holding one
    as ``[N blob data]``).  The fields keep each value as it was: they are data."""
    event = printable(str(event_dict.get("event", "")))
    pairs = [
        f"{printable(key)}={_message_value(value)}"
        for key, value in event_dict.items()
        if key not in _CONSUMED and key != "thread_name"
    ]
    message = " ".join([event, *pairs])
    for key in ("stack", "exception"):
        text = event_dict.get(key)
        if text:
            message += "\n" + printable_lines(str(text).rstrip("\n"))
    return message


def journal_fields(
    event_dict: Mapping[str, Any], method_name: str = "info"
) -> list[tuple[str, bytes]]:
    """The journal entry for one structlog event, as (FIELD, value) pairs.

    MESSAGE, PRIORITY, SYSLOG_IDENTIFIER=inferd, MESSAGE_ID (per event type),
    INFERD_EVENT (the event name), CODE_FILE /
    CODE_LINE / CODE_FUNC when known, INFERD_MODEL / INFERD_RUNTIME /
    INFERD_BUILD_ID / INFERD_CODE from ``model``, ``runtime``, ``build_id``,
    ``code``/``alert_code`` (also when an alert carries them in ``alert_fields``),
    and every other key as ``INFERD_<KEY>``.  Duplicate field names are allowed
    by journald and kept.
    """
    event = str(event_dict.get("event", ""))
    level = str(event_dict.get("level", method_name))
    fields: list[tuple[str, bytes]] = [
        ("MESSAGE", render_message(event_dict).encode("utf-8", "replace")),
        ("PRIORITY", str(PRIORITIES.get(level, 6)).encode()),
        ("SYSLOG_IDENTIFIER", SYSLOG_IDENTIFIER.encode()),
        ("MESSAGE_ID", message_id(event).encode()),
        ("INFERD_EVENT", event.encode("utf-8", "replace")),
    ]
    for key, name in _CODE_FIELDS:
        value = field_value(event_dict.get(key))
        if value is not None:
            fields.append((name, value))
    for key, value in event_dict.items():
        if key in _CONSUMED:
            continue
        rendered = field_value(value)
        if rendered is not None:
            fields.append((NAMED_FIELDS.get(key) or field_name(key), rendered))
    alert_fields = event_dict.get("alert_fields")
    if isinstance(alert_fields, Mapping):
        for key in _LIFTED_FROM_ALERT:
            if key not in event_dict:
                rendered = field_value(alert_fields.get(key))
                if rendered is not None:
                    fields.append((NAMED_FIELDS[key], rendered))
    return fields
