"""The checks a config section makes of one value, each refusal naming its key
(``refuse``: recorded while the section runs every rule, else raised)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from inferd.config.ceilings import MAX_OP_BURST, MAX_OP_REFILL_S, MIN_OP_REFILL_S
from inferd.config.refusals import refuse
from inferd_wire.endpoints import ipc_path_problem


def one_of(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        refuse(f"{key}: {value!r} is not one of {list(allowed)}", key)


def distinct(key: str, values: Sequence[str]) -> None:
    """A list of choices names each once: ``alerts.hooks = ["pub", "pub"]`` built two
    hooks, and every alert went out twice."""
    for index, value in enumerate(values):
        if values.index(value) != index:
            refuse(f"{key}: {value!r} is listed twice", key)
            return


def finite(key: str, value: float) -> None:
    # NaN passes every "<= 0" test (all its comparisons are False) and inf is
    # positive: both would reach timers and sleeps as a spin or a hang
    if not math.isfinite(value):
        refuse(f"{key} must be a finite number, got {value}", key)


def positive(key: str, value: float) -> None:
    finite(key, value)
    if value <= 0:
        refuse(f"{key} must be positive, got {value}", key)


def non_negative(key: str, value: float) -> None:
    finite(key, value)
    if value < 0:
        refuse(f"{key} must be zero or positive, got {value}", key)


def one_to(key: str, value: float, most: float, unit: str = "") -> None:
    """A count or a size: positive (said so, as before a ceiling), then at most
    ``most``, the range named."""
    positive(key, value)
    between(key, value, 1, most, unit)


def up_to(key: str, value: float, most: float, unit: str = "") -> None:
    between(key, value, 0, most, unit)


def positive_up_to(key: str, value: float, most: float, unit: str = "") -> None:
    """A duration that must pass: more than 0, at most ``most``, the range named so."""
    positive(key, value)
    if value > most:
        refuse(f"{key} must be more than 0 and at most {most:g}{unit}, got {value}", key)


def between(key: str, value: float, least: float, most: float, unit: str = "") -> None:
    finite(key, value)
    if not least <= value <= most:
        refuse(f"{key} must be {least}..{most}{unit}, got {value}", key)


def op_rate(section: str, op: str, burst: int, refill_s: float) -> None:
    """An operator op's per-peer rate: ``<section>.<op>_burst`` at once, then one
    more every ``<section>.<op>_refill_s`` seconds (``inferd.peer_rate_limit``)."""
    if not 1 <= burst <= MAX_OP_BURST:
        key = f"{section}.{op}_burst"
        refuse(f"{key} must be 1..{MAX_OP_BURST}, got {burst}", key)
    # NaN and inf fail the comparison too: neither is a refill
    if not MIN_OP_REFILL_S <= refill_s <= MAX_OP_REFILL_S:
        refuse(
            f"{section}.{op}_refill_s must be in [{MIN_OP_REFILL_S:g}, {MAX_OP_REFILL_S:g}] "
            f"seconds, got {refill_s}",
            f"{section}.{op}_refill_s",
        )


def socket_file(value: str) -> str:
    """What an endpoint binds, to tell two apart: an ``ipc://`` path normalised
    (``a/../b.sock`` is ``b.sock``, one file: the second bind would replace the
    first's), anything else as written."""
    path = value.removeprefix("ipc://")
    return f"ipc://{os.path.normpath(path)}" if path != value and path else value


def endpoint(key: str, value: str) -> None:
    """An ``ipc://`` path a socket can have, or a ``tcp://`` address libzmq binds as
    written: ``HOST:PORT``, an IPv6 host in one pair of brackets (``ZMQ_IPV6`` is set
    for ``tcp://[`` alone, ``inferd_wire.endpoints.wants_ipv6``: ``tcp://::1:5555``
    failed to bind with ENODEV, and so did ``tcp://[[::1]]:0``), and no ``source;``
    part, which libzmq takes on a connect only (every endpoint here is bound: EINVAL)."""
    if value.startswith("ipc://"):
        path = value.removeprefix("ipc://")
        if not path or path.startswith("@"):
            refuse(
                f"{key}: {value!r}: ipc endpoints must be filesystem paths (abstract sockets "
                "have no permissions)",
                key,
            )
        elif (problem := ipc_path_problem(path)) is not None:
            refuse(f"{key}: {problem}", key)
    elif value.startswith("tcp://"):
        host, colon, port = value.removeprefix("tcp://").rpartition(":")
        # libzmq 4.3 reads a port with atoi: "0" and "*" as written are any free port,
        # another port that reads 0 ("00") is EINVAL, leading zeros are read away
        # ("05555" binds 5555), and a port past 65535 is taken modulo 65536 (99999 binds
        # 34463, where no client would find the daemon).
        digits = port.lstrip("0")
        number = port.isascii() and port.isdigit() and 0 < len(digits) <= 5 and int(digits) < 65536
        bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
        bracketed = bracketed and host.count("[") == host.count("]") == 1  # "[[::1]]": ENODEV
        if ";" in value:
            refuse(
                f"{key}: {value!r}: a bound endpoint takes no 'source;' part (libzmq reads "
                "one on a connect only)",
                key,
            )
        elif any(char.isspace() for char in host):  # no interface, no address: ENODEV
            refuse(f"{key}: {value!r}: a host has no spaces", key)
        elif not bracketed and any(char in host for char in ":[]"):
            refuse(
                f"{key}: {value!r}: an IPv6 address goes in brackets, as tcp://[::1]:5555",
                key,
            )
        elif not (host and colon and (number or port in ("0", "*"))):
            refuse(
                f"{key}: {value!r} must name a host and a port 1..65535, or 0 or '*' for "
                "any free one (written so: libzmq refuses '00'), as in tcp://127.0.0.1:5555",
                key,
            )
    else:
        refuse(f"{key}: {value!r} must start with ipc:// or tcp://", key)
