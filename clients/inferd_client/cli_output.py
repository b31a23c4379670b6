"""Where ``inferctl`` writes what it has to say: each result on stdout, as one line
of JSON with ``--json`` or in its human layout (``cli_format``) without, and an
error as a JSON document on stdout (``--json``) or one line on stderr.  Every line
for a person passes ``cli_format.printable`` (no terminal control reaches the
screen), and a reply a layout cannot show (a daemon of another version: a field
missing or of another type) is shown as ``cli_format.generic`` lays it out."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

from inferd_client import cli_format
from inferd_client.errors import MalformedReply

#: What marks a msgpack ``bin`` in ``--json``, a map key or a value: then its bytes
#: in lowercase hex.  Unmarked, a bin key and a str key spelling its hex were one
#: key, and one entry was lost without a word (review R2, F4).
BIN_MARK = "hex:"

#: A human layout: a document as the lines a person reads.
Layout = Callable[[dict[str, Any]], list[str]]
#: What a layout raises on a reply of a shape it does not know.
UNEXPECTED_SHAPE = (KeyError, IndexError, TypeError, ValueError, AttributeError)


def emit(as_json: bool, document: dict[str, Any], layout: Layout | None = None) -> None:
    """One result: a JSON line, or ``layout``'s lines (``cli_format.generic`` by
    default)."""
    if as_json:
        print(json_line(document), flush=True)
    else:
        print_lines(laid_out(document, layout or cli_format.generic))


def laid_out(document: dict[str, Any], layout: Layout) -> list[str]:
    """``layout``'s lines, or, for a reply it cannot show, a note on stderr and
    the reply as ``generic`` lays it out: what the daemon said, never a traceback."""
    try:
        return layout(document)
    except UNEXPECTED_SHAPE as exc:
        note = f"{type(exc).__name__}: {exc}"
        print(
            cli_format.printable(
                f"inferctl: the reply is not laid out as this inferctl knows ({note}); "
                "shown as it came"
            ),
            file=sys.stderr,
        )
        return cli_format.generic(document)


def print_lines(lines: list[str]) -> None:
    """Lines for a person on stdout, each through ``cli_format.printable`` (none: nothing,
    as ``build status`` with no builds)."""
    if lines:
        print("\n".join(cli_format.printable(line) for line in lines), flush=True)


def emit_error(as_json: bool, code: str, message: str) -> None:
    if as_json:
        print(json_line({"ok": False, "error": {"code": code, "message": message}}))
    else:  # the daemon's message, or an exception's: escaped, and one line
        print(cli_format.printable(f"inferctl: {code}: {message}"), file=sys.stderr)


def json_line(document: dict[str, Any]) -> str:
    """``document`` as one line of JSON (RFC 8259): a float that is no number (a
    tensor's NaN or infinity) is ``null``, as JavaScript's ``JSON.stringify`` writes
    it, since ``NaN`` and ``Infinity`` are not JSON and strict parsers refuse them.
    A msgpack ``bin`` value or map key (the schemas have none; a daemon of another
    version, or a bug, may send one) is ``BIN_MARK`` and its bytes in lowercase hex
    (``"hex:01ff"``): it ended ``--json`` in a ``TypeError`` traceback, with nothing
    on stdout.  A map holding a bin key and a str key that reads as it (``"hex:…"``)
    is ``MalformedReply``: one JSON key cannot show both.  Any other value JSON has
    no type for (a msgpack ext value) is its ``repr``."""
    return json.dumps(_json_safe(document), sort_keys=True, allow_nan=False, default=repr)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bytes):
        return BIN_MARK + value.hex()
    if isinstance(value, dict):
        shown: dict[Any, Any] = {}
        for key, item in value.items():
            if isinstance(key, bytes):
                key = BIN_MARK + key.hex()
                if key in value:  # a str key spelt the same: never one of them lost
                    raise MalformedReply(
                        f"the reply holds a map with the bin key {key[len(BIN_MARK) :]} "
                        f"and the str key {key!r}: --json cannot show both"
                    )
            shown[key] = _json_safe(item)
        return shown
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value
