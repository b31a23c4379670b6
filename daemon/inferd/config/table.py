"""One TOML table read key by key, with every mistake collected rather than the
first raised: what ``inferd.config.loading`` builds each section from.

Rules that hold for every key: unknown keys are errors (with the nearest known
key), TOML types are strict (``true`` is not an integer), and no value is a NaN,
an infinity, an integer beyond 64 bits or a string with a NUL byte.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from inferd.config.refusals import ConfigErrorList, messages_of, refused_before
from inferd.errors import ConfigError

T = TypeVar("T")
P = ParamSpec("P")


class ConfigErrors:
    """Every mistake of one config, so that all of them are reported at once."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def add(self, message: str) -> None:
        self.messages.append(message)

    def section(self, build: Callable[[], T], fallback: Callable[[], T]) -> T:
        """``build()``, or ``fallback()`` once its error is recorded: a broken section
        must not hide the mistakes of the ones after it.  Each value a section
        refused is recorded (``inferd.config.refusals``: it raises them together)."""
        try:
            return build()
        except ConfigError as exc:
            self.messages.extend(messages_of(exc))
        except SectionAbandoned:
            pass  # its error is recorded already
        return fallback()

    def raise_any(self) -> None:
        if self.messages:
            raise ConfigErrorList(self.messages)


class SectionAbandoned(Exception):
    """A section that cannot be read further (a required key is missing)."""


class TomlTable:
    """Reads one TOML table, type-checks each key and rejects unknown ones.  A wrong
    value is recorded in ``errors`` and read as its default, so that the rest of
    the config is still checked; the section's rules then leave that key out
    (``finish_into``), as they never judge a value twice."""

    def __init__(self, data: Any, where: str, errors: ConfigErrors) -> None:
        self._where = where
        self._errors = errors
        self._known: list[str] = []
        #: ``where.key`` of each value refused as it was read.
        self._refused: set[str] = set()
        if not isinstance(data, dict):
            errors.add(f"{where} must be a table")
            data = {}
        self._data: dict[str, Any] = dict(data)

    def take(self, key: str, kind: type[T], default: T) -> T:
        value = self.take_optional(key, kind)
        return default if value is None else value

    def take_optional(self, key: str, kind: type[T]) -> T | None:
        """``key``'s value, or None when it is not given (or wrong: recorded in
        ``errors``); no value of ``kind`` stands for "not given"."""
        self._known.append(key)
        if key not in self._data:
            return None
        try:
            return self._convert(key, self._data.pop(key), kind)
        except ConfigError as exc:
            self.refuse(key, str(exc))
            return None

    def refuse(self, key: str, message: str) -> None:
        """``key``'s value is refused, as ``message`` says: recorded, and left out of
        the section's rules (its default, which they get instead, is not the user's)."""
        self._errors.add(message)
        self._refused.add(f"{self._where}.{key}")

    def take_required(self, key: str, kind: type[T]) -> T:
        self._known.append(key)
        if key not in self._data:
            # The section stops here, before its unknown keys are listed: name the
            # one that looks like a misspelling of this key now.
            near = difflib.get_close_matches(key, list(self._data), n=1)
            hint = f" (is {near[0]!r} a misspelling of it?)" if near else ""
            self._errors.add(f"{self._where}.{key} is required{hint}")
            raise SectionAbandoned
        try:
            return self._convert(key, self._data.pop(key), kind)
        except ConfigError as exc:
            self._errors.add(str(exc))
            raise SectionAbandoned from None

    def _convert(self, key: str, value: Any, kind: type[T]) -> T:
        # bool is an int subclass in Python; TOML keeps them apart, so do we.
        if isinstance(value, bool) and kind is not bool:
            ok = False
        elif kind is float and isinstance(value, int):
            # Checked as the integer it is first: past 64 bits it is refused as for
            # an integer key, and past a float float() would raise OverflowError.
            check_scalar(f"{self._where}.{key}", value)
            value, ok = float(value), True
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise ConfigError(
                f"{self._where}.{key} must be {kind.__name__}, got {type(value).__name__} {value!r}"
            )
        check_scalar(f"{self._where}.{key}", value)
        return value  # type: ignore[no-any-return]

    def take_path(self, key: str, default: str, what: str = "a directory") -> str:
        """A path as written, which must name ``what``: an empty one would resolve to
        its base (the config file's, state or runtime dir) and be used as that."""
        value = self.take(key, str, default)
        if not value.strip():  # recorded; the rest of the section is still checked
            self.refuse(key, f"{self._where}.{key} must name {what}, got an empty string")
            return default
        return value

    def take_strings(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.take(key, list, list(default))
        try:
            if not all(isinstance(item, str) for item in value):
                raise ConfigError(f"{self._where}.{key} must be a list of strings")
            for index, item in enumerate(value):
                check_scalar(f"{self._where}.{key}[{index}]", item)
        except ConfigError as exc:
            self.refuse(key, str(exc))
            return default
        return tuple(value)

    def table(self, key: str, where: str | None = None) -> TomlTable:
        """The sub-table ``key`` (empty when absent)."""
        return TomlTable(self.take(key, dict, {}), where or key, self._errors)

    def tables(self, key: str) -> list[Any]:
        """The array of tables ``key`` (``[[key]]``), as raw items."""
        return list(self.take(key, list, []))

    def take_dims(self, key: str) -> tuple[int, ...]:
        """A required shape: a non-empty list of integers (TOML integers, not ``true``)."""
        value = self.take_required(key, list)
        if not value or not all(
            isinstance(dim, int) and not isinstance(dim, bool) for dim in value
        ):
            raise ConfigError(
                f"{self._where}.{key} must be a non-empty list of integers, got {value!r}"
            )
        for index, dim in enumerate(value):
            if not 0 < dim <= _MAX_DIM:
                raise ConfigError(f"{self._where}.{key}[{index}] must be 1..{_MAX_DIM}, got {dim}")
        return tuple(value)

    @property
    def where(self) -> str:
        return self._where

    @property
    def errors(self) -> ConfigErrors:
        return self._errors

    def finish_into(self, factory: Callable[P, T], *args: P.args, **values: P.kwargs) -> T:
        """``factory(**values)`` once the table is finished: every value is taken
        (the arguments are evaluated first), so a value that the factory's own
        rules refuse never hides an unknown key of the same table.  The factory's
        rules leave out the keys refused as they were read (``refused_before``)."""
        self.finish()
        return refused_before(frozenset(self._refused), lambda: factory(*args, **values))

    def finish(self) -> None:
        for key in sorted(self._data):
            near = difflib.get_close_matches(key, self._known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            self._errors.add(f"{self._where}: unknown key {key!r}{hint}")


#: TOML integers are 64-bit; the daemon hands config integers to C (ZeroMQ options,
#: ONNX Runtime, sizes), so no value may leave that range either way.
_INT64 = range(-(2**63), 2**63)
#: A tensor dimension as the wire and TensorRT's ``Dims`` carry it.
_MAX_DIM = 2**31 - 1


def check_scalar(key: str, value: object) -> None:
    """What no config value may be, whatever its key: a NaN or infinite float
    (TOML allows ``nan`` and ``inf``), an integer beyond 64 bits, or a string
    with a NUL byte (no path, endpoint or name can hold one)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        raise ConfigError(f"{key} is out of range: {value} does not fit in 64 bits")
    if isinstance(value, str) and "\0" in value:
        raise ConfigError(f"{key} must not contain a NUL byte, got {value!r}")
