"""A ``Config`` as TOML: what ``inferd check-config`` prints, every key resolved.

The output is a config file the loader reads back into an equal ``Config``
(tested): paths absolute, defaults spelled out, values that have no TOML form
(an unset optional) left out with a comment saying so.  The table and key names
are the loader's (``inferd.config.loading``), section by section.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from inferd.config.sections import Config, ModelConfig
from inferd.config.security import SOCKETS, SecurityConfig

#: What a TOML basic string cannot hold as it is: ``"``, ``\`` and the control
#: characters (U+0000..U+001F and DEL).  Everything else is written as it is: JSON's
#: ``\ud83d\ude81`` surrogate pairs for a non-BMP character are not TOML.
_STRING_ESCAPES = {code: f"\\u{code:04x}" for code in (*range(0x20), 0x7F)} | {
    ord('"'): '\\"',
    ord("\\"): "\\\\",
}

#: The sections whose dataclass fields are their TOML keys, in the loader's order.
_SECTIONS = ("daemon", "bus", "runtime", "fdr", "alerts", "thermal", "builds", "shm", "metrics")


def config_to_toml(config: Config) -> str:
    lines = [f"# inferd config, resolved from {config.source}", ""]
    for name in _SECTIONS:
        lines += _table(name, _fields(getattr(config, name)))
    lines += _table("security", _security(config.security))
    for model in config.models:
        lines += _model(model)
    return "\n".join(lines).rstrip() + "\n"


def _fields(section: Any) -> list[tuple[str, Any]]:
    return [(field.name, getattr(section, field.name)) for field in dataclasses.fields(section)]


def _table(name: str, items: Iterable[tuple[str, Any]], *, array: bool = False) -> list[str]:
    lines = [f"[[{name}]]" if array else f"[{name}]"]
    for key, value in items:
        text = _value(value)
        lines.append(f"# {key}: not set" if text is None else f"{key} = {text}")
    return [*lines, ""]


def _value(value: Any) -> str | None:
    """``value`` as a TOML value, or None when TOML cannot say it (not set)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _value(value.value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else None
    if isinstance(value, Path | str):
        return '"' + str(value).translate(_STRING_ESCAPES) + '"'
    if isinstance(value, tuple | list):
        items = [_value(item) for item in value]
        return "[" + ", ".join(item for item in items if item is not None) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _security(security: SecurityConfig) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for name in SOCKETS:
        access = security.access(name)
        items.append((f"{name}_group", access.group_name))
        items.append((f"{name}_allow", [principal.text for principal in access.allow]))
    return [
        *items,
        ("operators", [principal.text for principal in security.operators]),
        ("curve", security.curve),
        ("curve_secret_key", security.curve_secret_key),
        ("curve_clients_dir", security.curve_clients_dir),
    ]


def _model(model: ModelConfig) -> list[str]:
    items = [(key, value) for key, value in _fields(model) if key != "profiles"]
    lines = _table("models", items, array=True)
    for profile in model.profiles:
        lines += _table("models.profiles", _fields(profile), array=True)
    return lines
