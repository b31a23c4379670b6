"""Every refused value of a config section at once: while a section's
``__post_init__`` runs under ``every_rule``, a rule that refuses a value records
its message (``refuse``) and the rules after it still run; the section then
raises one ``ConfigErrorList`` naming each refused value.  Outside a section (a
check called on its own) ``refuse`` raises at once.

A value refused once is not judged again (``one_to``'s "must be positive" is not
followed by its "must be 1..N", and a rule between two values is left out when
either was refused on its own), so each mistake reads as one message, as the
first did when a section stopped at it.  That holds for a value refused before
the section's rules run too (a wrong TOML type, a path written empty: the
section gets its default, ``refused_before``): no rule judges that default, which
the user never wrote.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import TypeVar

from inferd.errors import ConfigError

S = TypeVar("S")


class ConfigErrorList(ConfigError):
    """Several mistakes, each its own message (``messages``): one reads as that
    message alone, more as a count and a list."""

    def __init__(self, messages: Sequence[str]) -> None:
        self.messages = tuple(messages)
        if len(self.messages) == 1:
            text = self.messages[0]
        else:
            listed = "\n".join(f"  - {message}" for message in self.messages)
            text = f"{len(self.messages)} errors:\n{listed}"
        super().__init__(text)


def messages_of(error: ConfigError) -> tuple[str, ...]:
    """The mistakes ``error`` names, one message each."""
    return error.messages if isinstance(error, ConfigErrorList) else (str(error),)


class _Refusals:
    def __init__(self, refused: frozenset[str]) -> None:
        self.messages: list[str] = []
        self._keys: set[str] = set(refused)

    def add(self, message: str, keys: tuple[str, ...]) -> None:
        if self._keys.isdisjoint(keys):
            self.messages.append(message)
            self._keys.update(keys)


#: The refusals of the section whose rules are running on this thread, if any.
_running: ContextVar[_Refusals | None] = ContextVar("inferd_config_refusals", default=None)
#: The keys of the section about to be made that were refused as they were read.
_refused_before: ContextVar[frozenset[str]] = ContextVar(
    "inferd_config_refused_before", default=frozenset()
)


def refused_before(keys: frozenset[str], make: Callable[[], S]) -> S:
    """``make()``, a section whose rules leave out every rule naming one of ``keys``
    (``"bus.max_frames"``): their values were refused as they were read, and the
    section holds their defaults instead."""
    token = _refused_before.set(keys)
    try:
        return make()
    finally:
        _refused_before.reset(token)


def refuse(message: str, *keys: str) -> None:
    """The values of ``keys`` break a rule, as ``message`` says: recorded while a
    section runs its rules (``every_rule``) unless one of them was refused before,
    else raised as ``ConfigError``."""
    refusals = _running.get()
    if refusals is None:
        raise ConfigError(message)
    refusals.add(message, keys)


def every_rule(post_init: Callable[[S], None]) -> Callable[[S], None]:
    """Decorates a section's ``__post_init__``: each of its rules runs, and the
    values they refused are raised together (``ConfigErrorList``).  A rule that
    raises instead ends the section there, its message kept with the others."""

    @functools.wraps(post_init)
    def checked(section: S) -> None:
        refusals = _Refusals(_refused_before.get())
        token = _running.set(refusals)
        inner = _refused_before.set(frozenset())  # not for a section its rules make
        try:
            post_init(section)
        except ConfigError as exc:
            refusals.messages.extend(messages_of(exc))
        finally:
            _refused_before.reset(inner)
            _running.reset(token)
        if refusals.messages:
            raise ConfigErrorList(refusals.messages)

    return checked
