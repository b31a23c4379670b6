"""Repeated requests on ``shm.sock``: a message's bytes but for its id (DESIGN.md 109).

A camera loop sends the same infer request again and again, and the Python
client encodes it once and appends only the id (``ShmRequest``: the header's
bytes with ``"id"`` as its last key, then the id as a msgpack unsigned int).
``repeat_of`` splits such a message into the bytes before the id (``prefix``)
and the id.  Two messages with the same prefix decode to the same header but
for the id: msgpack is self-delimiting, so a decoder reads both identically up
to the prefix's end, and what follows is, in each, one complete unsigned int
ending the message, in the slot after the key ``"id"``.  The router admits a
message whose prefix it has admitted before on the same connection from what
it prepared then (``serving/prepared.py``); any other message, or a header
that ends with something else, is decoded and checked as always.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``"id"`` as a msgpack fixstr: the key before the id.
_ID_KEY = b"\xa2id"
#: Each msgpack unsigned int encoding's length by its type byte (uint 64..8: the
#: clients' ids are 64-bit).
_UINT_BYTES = {0xCF: 9, 0xCE: 5, 0xCD: 3, 0xCC: 2}


@dataclass(frozen=True)
class Repeat:
    """A message split at its trailing id: the bytes before it, and its value."""

    prefix: bytes
    request_id: int


def repeat_of(data: bytes) -> Repeat | None:
    """``data`` split at the id it ends with (the key ``"id"``, then an unsigned
    int), or None when it ends otherwise."""
    if len(data) > 12 and data[-9] == 0xCF and data[-12:-9] == _ID_KEY:  # the clients' ids
        return Repeat(data[:-9], int.from_bytes(data[-8:], "big"))
    if len(data) < 5:
        return None
    last = data[-1]
    if last < 0x80 and data[-4:-1] == _ID_KEY:  # a positive fixint: the int is one byte
        return Repeat(data[:-1], last)
    for type_byte, length in _UINT_BYTES.items():
        end = len(data) - length
        if end > 3 and data[end] == type_byte and data[end - 3 : end] == _ID_KEY:
            return Repeat(data[:end], int.from_bytes(data[end + 1 :], "big"))
    return None
