"""Free text a client sends that the daemon keeps as sent (``requested_by``, a
cancel's ``reason``, ``simulation.fail``, a region's ``label``) must be printable
(``inferd_wire.protocol.require_text``), and the schemas say so: a control character
there went as sent to journald, the FDR, events and a ground station's STATUSTEXT
(DESIGN.md 252 escaped it on the terminal only).  ``model_name`` states the config's
rule (DESIGN.md 254): 1..64 ASCII letters, digits, '-' or '_'."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import pytest

from inferd.config.sections import MODEL_NAME
from inferd_wire.protocol import Code, ProtocolError, require_text
from inferd_wire.regions import parse_label
from tests.integration.test_schemas import schema_errors, schemas

#: Each text's first character that is not printable is its fourth (index 3).
FORBIDDEN = {
    "OSC 52 clipboard write": "ops\x1b]52;c;cm0gLXJmIH4=\x07",
    "CR LF forged line": "ops\r\nFORGED alert",
    "C1 CSI": "ops\x9b2J",
    "bidi override": "ops\u202egnp.exe",
    "line separator": "ops\u2028x",
    "NUL": "ops\x00",
    "DEL": "ops\x7f",
    "zero-width space": "ops\u200bx",
    "no-break space": "ops\u00a0x",
    "astral tag": "ops\U000e0041",
}
#: Printable, so kept: the rest of Unicode is welcome.
PRINTABLE = ("opérateur 日本 ✓", "ground station #2 (alice) [ops]", "x" * 64)


def refusal(field: str, text: str) -> str:
    """The message the daemon answers ``text`` in ``field`` with."""
    code = ord(text[3])
    return (
        f"'{field}' must be printable text: its character 3 (counting from 0) is "
        f"U+{code:04X}, which is not printable"
    )


@pytest.mark.parametrize("text", FORBIDDEN.values(), ids=FORBIDDEN.keys())
def test_require_text_names_the_field_the_index_and_the_code_point(text: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        require_text(text, "requested_by", 64)
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert refused.value.message == refusal("requested_by", text)


def test_require_text_keeps_printable_unicode_and_bounds_the_length() -> None:
    assert [require_text(text, "reason", 64) for text in PRINTABLE] == list(PRINTABLE)
    for bad in ("", "x" * 65, 7, None):
        with pytest.raises(ProtocolError) as refused:
            require_text(bad, "reason", 64)
        assert refused.value.message == "'reason' must be a string of 1..64 characters"


@pytest.mark.parametrize("text", FORBIDDEN.values(), ids=FORBIDDEN.keys())
def test_a_region_label_is_refused_naming_the_character(text: str) -> None:
    """The shm label check was the one printable check; it is now the shared one, and
    says which character (it said only "1..64 printable characters")."""
    with pytest.raises(ProtocolError) as refused:
        parse_label(text)
    assert refused.value.message == refusal("label", text)
    assert parse_label("cam 0 ✓") == "cam 0 ✓" and parse_label(None) is None


def control(**fields: Any) -> dict[str, Any]:
    return {"v": 1, "id": 1, **fields}


FIELDS = {
    "runtime.switch requested_by": lambda text: control(
        op="runtime.switch", model="demo", runtime="tensorrt", requested_by=text
    ),
    "build.start requested_by": lambda text: control(
        op="build.start", model="demo", requested_by=text
    ),
    "build.start simulation.fail": lambda text: control(
        op="build.start", model="demo", builder="simulated", simulation={"fail": text}
    ),
    "build.cancel reason": lambda text: control(op="build.cancel", build_id="b1", reason=text),
}


@pytest.mark.parametrize("message", FIELDS.values(), ids=FIELDS.keys())
def test_the_control_schema_refuses_free_text_that_is_not_printable(message: Any) -> None:
    for text in PRINTABLE:
        assert schema_errors("control_request.json", message(text)) == []
    # Python's ``re`` lets "$" match before a final "\n" (ECMA-262, the schemas'
    # dialect, does not), so a text is never ended by the character under test here.
    for name, text in FORBIDDEN.items():
        if ord(text[3]) > 0xFFFF:
            continue  # past the BMP: the daemon's, not the portable pattern's (below)
        assert schema_errors("control_request.json", message(text + "!")), name


def test_the_shm_schema_refuses_a_label_that_is_not_printable() -> None:
    register = {"v": 1, "id": 1, "op": "register"}
    assert schema_errors("shm_request.json", {**register, "label": "cam 0 ✓"}) == []
    assert schema_errors("shm_request.json", {**register, "label": "cam\x1b[2J!"})


def test_the_printable_pattern_refuses_only_what_the_daemon_refuses() -> None:
    """Every code point the schema's pattern refuses is one ``str.isprintable`` refuses
    (a client following the schema is never refused by it), and it refuses every
    assigned one of the BMP (what a portable pattern can list)."""
    pattern = re.compile(schemas()["common.json"]["$defs"]["printable_text"]["pattern"])
    refused = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    refused = [c for c in refused if pattern.search(chr(c) + "!") is None]
    assert [hex(c) for c in refused if chr(c).isprintable()] == []
    missed = [
        hex(c)
        for c in range(0x10000)
        if not 0xD800 <= c <= 0xDFFF
        and not chr(c).isprintable()
        and unicodedata.category(chr(c)) != "Cn"  # unassigned: Unicode-version dependent
        and c not in refused
    ]
    assert missed == []


NAMES = ("demo", "a", "Det_2-x", "9lives", "x" * 64, "", "x" * 65, "-x", "_x", "a b", "é", "a.b")


def test_the_schema_model_name_is_the_configs() -> None:
    """``common.json#/$defs/model_name`` had no pattern or bound: it took any string,
    while the config takes 1..64 ASCII letters, digits, '-' or '_' (DESIGN.md 254)."""
    differ = [
        name
        for name in NAMES
        if (schema_errors("common.json#/$defs/model_name", name) == [])
        != bool(MODEL_NAME.fullmatch(name))
    ]
    assert differ == []
