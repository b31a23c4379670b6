"""The checks a config section makes of one value, each ``ConfigError`` naming
its key."""

from __future__ import annotations

import math

from inferd.errors import ConfigError
from inferd_wire.endpoints import ipc_path_problem


def one_of(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}")


def finite(key: str, value: float) -> None:
    # NaN passes every "<= 0" test (all its comparisons are False) and inf is
    # positive: both would reach timers and sleeps as a spin or a hang
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")


def positive(key: str, value: float) -> None:
    finite(key, value)
    if value <= 0:
        raise ConfigError(f"{key} must be positive, got {value}")


def non_negative(key: str, value: float) -> None:
    finite(key, value)
    if value < 0:
        raise ConfigError(f"{key} must be zero or positive, got {value}")


def one_to(key: str, value: float, most: float, unit: str = "") -> None:
    """A count or a size: positive (said so, as before a ceiling), then at most
    ``most``, the range named."""
    positive(key, value)
    between(key, value, 1, most, unit)


def up_to(key: str, value: float, most: float, unit: str = "") -> None:
    between(key, value, 0, most, unit)


def between(key: str, value: float, least: float, most: float, unit: str = "") -> None:
    finite(key, value)
    if not least <= value <= most:
        raise ConfigError(f"{key} must be {least}..{most}{unit}, got {value}")


def endpoint(key: str, value: str) -> None:
    """An ``ipc://`` path a socket can have, or a ``tcp://`` address whose port
    libzmq binds as written."""
    if value.startswith("ipc://"):
        path = value.removeprefix("ipc://")
        if not path or path.startswith("@"):
            raise ConfigError(
                f"{key}: {value!r}: ipc endpoints must be filesystem paths (abstract sockets "
                "have no permissions)"
            )
        problem = ipc_path_problem(path)
        if problem is not None:
            raise ConfigError(f"{key}: {problem}")
    elif value.startswith("tcp://"):
        # libzmq binds what follows a ';' (a connect's source address comes before it)
        host, colon, port = value.removeprefix("tcp://").split(";")[-1].rpartition(":")
        # libzmq takes a port past 65535 modulo 65536 (99999 binds 34463): no client
        # would find the daemon there; 0 and '*' are any free port, as libzmq says
        number = port.isascii() and port.isdigit() and len(port) <= 5 and int(port) < 65536
        if not (host and colon and (number or port == "*")):
            raise ConfigError(
                f"{key}: {value!r} must name a host and a port 0..65535 (0 or '*': any "
                "free one), as in tcp://127.0.0.1:5555"
            )
    else:
        raise ConfigError(f"{key}: {value!r} must start with ipc:// or tcp://")
