"""Repeated requests: a message's bytes but for its id (DESIGN.md 109, 114).

A camera loop sends the same infer request again and again, and the Python
client encodes it once and appends only the id (``ShmRequest``: the header's
bytes with ``"id"`` as its last key, then the id as a msgpack unsigned int).
``repeat_of`` splits such a message into the bytes before the id (``prefix``)
and the id.  Two messages with the same prefix decode to the same header but
for the id: msgpack is self-delimiting, so a decoder reads both identically up
to the prefix's end, and what follows is, in each, one complete unsigned int
ending the message, in the slot after the key ``"id"``, provided that slot is
the id's (``splits_at_id``, checked once).  The router admits a message whose
prefix it has admitted before on the same connection from what it prepared
then (``serving/prepared.py``); any other message, or a header that ends with
something else, is decoded and checked as always.  On the infer socket the
header frame is split the same way, and the tensor frames that follow it are
checked against what the prepared admission expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from inferd.bus.headers import InferHeader, decode_infer
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES

#: The longest message (or infer socket header) split: what the router keeps of a
#: prepared one is bounded by it (``serving.prepared``), as shm.sock's messages are.
MAX_REPEAT_BYTES = MAX_SHM_MESSAGE_BYTES

#: ``"id"`` as a msgpack fixstr: the key before the id.
_ID_KEY = b"\xa2id"
#: Each msgpack unsigned int encoding's length by its type byte (uint 64..8: the
#: clients' ids are 64-bit).
_UINT_BYTES = {0xCF: 9, 0xCE: 5, 0xCD: 3, 0xCC: 2}


#: Two ids a prefix is tried with (``splits_at_id``): a byte that belongs to
#: something else (a string, a float) cannot take both values unnoticed.
_PROBES = (b"\x00", b"\x01")


def splits_at_id(prefix: bytes, header: InferHeader) -> bool:
    """Whether the bytes ``prefix`` end exactly where the id of ``header`` (decoded
    from them and the id) begins: then any unsigned int after them is that header
    with another id.  The trailing key and int alone do not say so: the bytes
    ``"id"`` and an int may end a string or a float that happens to be the
    header's last value.  Checked once, when an admission is prepared."""
    for request_id, probe in enumerate(_PROBES):
        if decode_infer(prefix + probe) != msgspec.structs.replace(header, id=request_id):
            return False
    return True


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
