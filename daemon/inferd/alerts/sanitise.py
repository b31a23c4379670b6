"""One bounded, encodable form of an alert, made once by the dispatcher for every hook.

A raiser's alert may hold what a hook cannot send: a lone surrogate (what
``os.fsdecode`` gives for a non-UTF-8 file name; msgpack and UTF-8 refuse it), a
value msgpack cannot pack (a ``Path``, an int over 64 bits, a non-string map
key), or a message of a megabyte.  ``sanitised`` returns the alert as every hook
(PUB, FDR, MAVLink) and the ``alert`` log line can take it: strings escaped as
UTF-8 can hold them (``\\udce9``) and cut to their limit in bytes of UTF-8
(``... [cut: N characters]``, N the length as raised, as ``cut_long_values``
says it), at most ``MAX_VALUES`` values in ``fields`` at every depth, a map or
list at ``MAX_DEPTH`` and anything else that is not None, bool, int (64 bits),
float, str, list, tuple or a map as its bounded ``repr``, a map key that is no
string as its ``repr``: ``MAX_PACKED_BYTES`` at most.  NaN and infinities are
kept: msgpack packs them, and ``inferctl --json``, ``inferd fdr dump --json``,
the MCAP export and the C++ client write them as JSON null (the ``json`` log
format as ``NaN``, as for any log field); strings would change a field's type.
What is fine is kept as it is: an alert that needs no change is not copied
(``sanitised`` returns None), and a map or list is copied only when something
in it changes.
"""

from __future__ import annotations

import itertools
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The limits are bytes of UTF-8, not characters: a character takes up to 4, so
# limits in characters let an alert of 4-byte characters reach 213 KiB.
#: The message's bytes: one of a megabyte went whole to every hook and into
#: the log line, and the FDR refused it (over the 1 MiB record limit).
MESSAGE_BYTES = 4096
#: Bytes of each string in ``fields``.
VALUE_BYTES = 512
#: Values in ``fields``, at every depth together (a map or list counts as one).
#: A sanitised alert goes on the PUB socket too, whose queue for a slow subscriber
#: is counted in events, not bytes (1000 of 300 KiB, the first bound, was 300 MB
#: held for one reader): see ``MAX_PACKED_BYTES``.
MAX_VALUES = 64
#: A map or list at this depth (a field's own value is at 1) becomes its ``repr``.
MAX_DEPTH = 4
#: Bytes of the code and of a map key.
KEY_BYTES = 128
#: The most an alert's FDR record (level, code, message, ``fields``, ``suppressed``
#: and the ``sanitised`` marker) packs to with msgpack: the limits above, each cut
#: string's note and ``changed`` naming up to 64 fields.  Measured with strings of
#: 100,000 characters as raised, of any width: 57.9 KiB (the PUB event, without
#: the marker, 47.7 KiB); each further digit in the notes' lengths adds under 200
#: bytes, so it holds for strings up to 10**12 characters (``test_alert_byte_bound``).
MAX_PACKED_BYTES = 60 * 1024
#: The integers msgpack packs (int64 and uint64).
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1

#: Why a string or value was changed (``Sanitised.reason``, in this order).
SURROGATE = "a lone surrogate (not UTF-8)"
TOO_LONG = "a string over its limit"
NOT_PACKABLE = "a value msgpack cannot pack"
NOT_STR_KEY = "a map key that is not a string"
TOO_MANY = f"over {MAX_VALUES} values"
TOO_DEEP = f"nested deeper than {MAX_DEPTH - 1} levels"
_REASONS = (SURROGATE, TOO_LONG, NOT_PACKABLE, NOT_STR_KEY, TOO_MANY, TOO_DEEP)

#: What ``escaped`` appends to a string it cut.
_CUT_NOTE = re.compile(r" \[cut: \d+ characters\]\Z")

_repr = reprlib.Repr()  # bounded whatever the object's size (a list of a million items)
_repr.maxstring = _repr.maxother = 1024
_repr.maxlong = 64


@dataclass(frozen=True)
class Sanitised:
    """An alert's code, message and fields as hooks can take them."""

    code: str
    message: str
    fields: dict[str, Any]
    #: What differs from the alert as raised: ``code``, ``message``,
    #: ``fields.<key>``, or ``fields`` when values were left out; empty when only
    #: the containers were copied (a ``MappingProxyType`` as or in ``fields``).
    changed: list[str]
    #: Why, from the ``_REASONS`` that apply, joined by "; " ("" when nothing changed).
    reason: str


def escaped(text: str, limit: int) -> str:
    """``text`` as UTF-8 can hold it (a lone surrogate as ``\\udce9``), cut to
    ``limit`` bytes of UTF-8 (whole characters), then the cut's note."""
    kept, cut, _surrogate = _cut(text, limit)
    return _noted(text, kept, cut)


def recut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` bytes of UTF-8; when ``escaped`` cut it already,
    the note keeps the length of the text as raised."""
    note = _CUT_NOTE.search(text)
    if note is None:
        return escaped(text, limit)
    kept, _cut_again, _surrogate = _cut(text[: note.start()], limit)
    return f"{kept}{note.group(0)}"


def _noted(text: str, kept: str, cut: bool) -> str:
    """What ``_cut`` kept of ``text``, with the note when it cut it."""
    return f"{kept} [cut: {len(text)} characters]" if cut else kept


def _cut(text: str, limit: int) -> tuple[str, bool, bool]:
    """``text`` escaped and cut to ``limit`` bytes of UTF-8, without a note;
    whether it was cut; whether what is kept held a lone surrogate."""
    head = text[:limit]  # ``limit`` bytes hold ``limit`` characters at most
    try:
        data = head.encode("utf-8")
    except UnicodeEncodeError:
        data = head.encode("utf-8", "backslashreplace")
    if len(text) <= limit and len(data) <= limit:
        kept, cut = data.decode("utf-8"), False
    else:  # "ignore" drops only a character cut in half, at the end
        kept, cut = data[:limit].decode("utf-8", "ignore"), True
    # The escaped text differs from the raw one from its first escape on (a
    # surrogate's, whole or cut): where none was kept, it is the raw start.
    return kept, cut, kept != head[: len(kept)]


def bounded_repr(value: Any) -> str:
    try:
        return _repr.repr(value)
    except Exception:  # a __repr__ that raises, an int over sys.get_int_max_str_digits
        return f"<{type(value).__name__}>"


def _fits(text: str, limit: int) -> bool:
    """Whether ``text`` needs no change: the common case costs a length and an
    ``isascii`` check (both O(1) on CPython), no copy; other text is encoded
    (``limit`` characters at most) to count its bytes."""
    return len(text) <= limit and (text.isascii() or _utf8_within(text, limit))


def _utf8_within(text: str, limit: int) -> bool:
    try:
        return len(text.encode("utf-8")) <= limit
    except UnicodeEncodeError:
        return False


def sanitised(code: str, message: str, fields: Mapping[str, Any]) -> Sanitised | None:
    """The alert as hooks can take it, or None when it already is (nothing copied).

    ``fields`` comes back a ``dict`` built here unless it is one that needs no
    change: what hooks get is never read from a raiser's own mapping type again.
    A map whose ``items()`` raises, ``fields`` itself included, leaves ``fields``
    empty (``reason`` ``fields cannot be read: ...``): the alert is still delivered."""
    try:  # the quick check reads ``fields`` too
        if (
            type(code) is str
            and _fits(code, KEY_BYTES)
            and type(message) is str
            and _fits(message, MESSAGE_BYTES)
            and type(fields) is dict
            and _fine_map(fields, 1, MAX_VALUES) >= 0
        ):
            return None
        return _Sanitiser().alert(code, message, fields)
    except Exception as exc:  # a raiser's bug in a map: the alert is not lost
        unread = _Sanitiser().alert(code, message, {})
        return Sanitised(
            code=code if unread is None else unread.code,
            message=message if unread is None else unread.message,
            fields={},
            changed=[*([] if unread is None else unread.changed), "fields"],
            reason=f"fields cannot be read: {escaped(bounded_repr(exc), VALUE_BYTES)}",
        )


# The check of the common case, an alert that needs no change: exact types, no
# allocation (2 us for five fields, a third of ``_Sanitiser``'s time); what it does
# not know (a subclass) is left to ``_Sanitiser``, which may keep it.
def _fine_map(mapping: Mapping[Any, Any], depth: int, left: int) -> int:
    """The values left after ``mapping``'s (at ``depth``), or -1 if one needs a change."""
    for key, value in mapping.items():
        if type(key) is not str or not _fits(key, KEY_BYTES):
            return -1
        left = _fine_value(value, depth, left)
        if left < 0:
            return -1
    return left


def _fine_value(value: Any, depth: int, left: int) -> int:
    left -= 1
    kind = type(value)
    if kind is str:
        return left if _fits(value, VALUE_BYTES) else -1
    if value is None or kind is bool or kind is float:
        return left
    if kind is int:
        return left if INT_MIN <= value <= INT_MAX else -1
    if depth >= MAX_DEPTH or left < 0:
        return -1
    if kind is dict:
        return _fine_map(value, depth + 1, left)
    if kind is list or kind is tuple:
        for item in value:
            left = _fine_value(item, depth + 1, left)
            if left < 0:
                return -1
        return left
    return -1


class _Sanitiser:
    def __init__(self) -> None:
        self._left = MAX_VALUES
        self._reasons: set[str] = set()
        self.changed: list[str] = []

    def alert(self, code: Any, message: Any, fields: Mapping[str, Any]) -> Sanitised | None:
        clean_code = self._text(code, KEY_BYTES)
        clean_message = self._text(message, MESSAGE_BYTES)
        for name, clean, raw in (("code", clean_code, code), ("message", clean_message, message)):
            if clean is not raw:
                self.changed.append(name)
        clean_fields = self._fields(fields)
        if clean_fields is fields and not self.changed:
            return None
        return Sanitised(
            code=clean_code,
            message=clean_message,
            fields=dict(clean_fields),
            changed=self.changed,
            reason="; ".join(reason for reason in _REASONS if reason in self._reasons),
        )

    def _text(self, text: Any, limit: int) -> str:
        """``text`` itself when it fits ``limit``, else an escaped, cut copy."""
        if not isinstance(text, str):
            self._reasons.add(NOT_PACKABLE)
            return escaped(bounded_repr(text), limit)
        if _fits(text, limit):
            return text
        kept, cut, surrogate = _cut(text, limit)
        if cut:
            self._reasons.add(TOO_LONG)
        if surrogate:  # in what is kept
            self._reasons.add(SURROGATE)
        return _noted(text, kept, cut)

    def _fields(self, fields: Mapping[str, Any]) -> Mapping[str, Any]:
        """``fields`` itself when nothing in it changes, else a copy; names each
        changed field in ``changed``.  A ``fields`` that is no ``dict`` is copied
        as it is read, once: hooks never read a raiser's own mapping type."""
        copy: dict[str, Any] | None = None if type(fields) is dict else {}
        for index, (key, value) in enumerate(fields.items()):
            if self._left <= 0:
                self._reasons.add(TOO_MANY)
                self.changed.append("fields")  # the others are left out
                return copy if copy is not None else _head(fields, index)
            name = self._key(key)
            clean, differs = self._value(value, 1)
            if copy is None and (clean is not value or name is not key):
                copy = _head(fields, index)
            if differs or name is not key:
                self.changed.append(f"fields.{name}")
            if copy is not None:
                copy[name] = clean
        return copy if copy is not None else fields

    def _key(self, key: Any) -> str:
        if isinstance(key, str):
            return self._text(key, KEY_BYTES)
        self._reasons.add(NOT_STR_KEY)
        return escaped(bounded_repr(key), KEY_BYTES)

    def _value(self, value: Any, depth: int) -> tuple[Any, bool]:
        """``value`` itself when hooks can take it, else a bounded copy; and
        whether that says something else than ``value`` (a map copied only
        because it was no ``dict`` does not)."""
        self._left -= 1
        if value is None or isinstance(value, (bool, float)):
            return value, False
        if isinstance(value, int):
            if INT_MIN <= value <= INT_MAX:
                return value, False
        elif isinstance(value, str):
            clean = self._text(value, VALUE_BYTES)
            return clean, clean is not value
        elif isinstance(value, (Mapping, list, tuple)):
            if depth < MAX_DEPTH:
                if isinstance(value, Mapping):
                    return self._map(value, depth + 1)
                return self._list(value, depth + 1)
            self._reasons.add(TOO_DEEP)
            return escaped(bounded_repr(value), VALUE_BYTES), True
        self._reasons.add(NOT_PACKABLE)
        return escaped(bounded_repr(value), VALUE_BYTES), True

    def _map(self, value: Mapping[Any, Any], depth: int) -> tuple[Any, bool]:
        # msgpack packs a dict (and its subclasses), no other mapping.
        copy: dict[str, Any] | None = None if isinstance(value, dict) else {}
        changed = False
        for index, (key, item) in enumerate(value.items()):
            if self._left <= 0:
                self._reasons.add(TOO_MANY)
                return (copy if copy is not None else _head(value, index)), True
            name = self._key(key)
            clean, differs = self._value(item, depth)
            if copy is None and (clean is not item or name is not key):
                copy = _head(value, index)
            changed = changed or differs or name is not key
            if copy is not None:
                copy[name] = clean
        return (value if copy is None else copy), changed

    def _list(self, value: list[Any] | tuple[Any, ...], depth: int) -> tuple[Any, bool]:
        copy: list[Any] | None = None
        changed = False
        for index, item in enumerate(value):
            if self._left <= 0:
                self._reasons.add(TOO_MANY)
                return (copy if copy is not None else list(value[:index])), True
            clean, differs = self._value(item, depth)
            if copy is None and clean is not item:
                copy = list(value[:index])
            changed = changed or differs
            if copy is not None:
                copy.append(clean)
        return (value if copy is None else copy), changed


def _head(items: Mapping[Any, Any], count: int) -> dict[Any, Any]:
    """The first ``count`` items of a map (all kept as they were) as a dict."""
    return dict(itertools.islice(items.items(), count))
