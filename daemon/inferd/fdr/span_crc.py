"""CRC32C of any span of one buffer without reading the span: for the reader's
resynchronisation, which tries a frame at every sync marker after damage.

Each marker claims a body of up to 1 MiB, and a valid frame may start inside a
candidate that failed, so no candidate can be skipped: checking each with its
own CRC costs up to 1 MiB per marker (a segment packed with markers 12 bytes
apart took 8.5 s a MiB).  CRC32C is linear: with ``C(x)`` the CRC of the buffer
from an origin to ``x``, and ``advance(v, n)`` the CRC register ``v`` run
through ``n`` zero bytes (a linear map on 32 bits)::

    crc32c(data[s:e]) == C(e) ^ advance(C(s), e - s)

``C`` is kept at every ``_GRID`` bytes, hashed forward (each byte once) as far
as a span needs; a span is taken as its ragged ends (hashed, at most ``_GRID``
bytes each) around a run of whole grid cells, whose length is a multiple of
``_GRID``: ``advance`` over it is three look-ups in byte-sliced tables (for 1..15
times each power of 16 cells).  A span costs that, whatever its length.
"""

from __future__ import annotations

import functools
from array import array

import google_crc32c

#: Bytes between two stored prefix CRCs: a span hashes at most twice this.
_GRID = 512
#: ``advance`` reads a count of grid cells in hex digits, one table look-up each:
#: below 16**3 cells (2 MiB; a frame is at most 1 MiB).
_DIGITS = 3
_MAX_CELLS = 16**_DIGITS

_Map = tuple[list[int], list[int], list[int], list[int]]


def _apply(table: _Map, value: int) -> int:
    return (
        table[0][value & 0xFF]
        ^ table[1][(value >> 8) & 0xFF]
        ^ table[2][(value >> 16) & 0xFF]
        ^ table[3][value >> 24]
    )


def _tables(basis: list[int]) -> _Map:
    """The byte-sliced tables of the linear map that takes bit ``i`` to ``basis[i]``."""
    slices = []
    for byte in range(4):
        table = [0] * 256
        for index in range(1, 256):
            low = index & -index
            table[index] = table[index ^ low] ^ basis[8 * byte + low.bit_length() - 1]
        slices.append(table)
    return (slices[0], slices[1], slices[2], slices[3])


def _zeros(value: int, length: int) -> int:
    """The register ``value`` through ``length`` zero bytes, hashed (``extend`` inverts
    the register before and after)."""
    return int(google_crc32c.extend(value ^ 0xFFFFFFFF, bytes(length))) ^ 0xFFFFFFFF


@functools.cache  # built once, at the first resynchronisation that needs it
def _advance_tables() -> list[list[_Map]]:
    """``[digit][d]``: the map for ``d * 16**digit`` cells of zeros (``d`` 1..15)."""
    unit = [_zeros(1 << bit, _GRID) for bit in range(32)]  # one cell
    per_digit: list[list[_Map]] = []
    for _digit in range(_DIGITS):
        unit_map = _tables(unit)
        maps = [unit_map, unit_map]  # [0] is never used
        basis = unit
        for times in range(2, 17):
            basis = [_apply(unit_map, value) for value in basis]
            if times < 16:
                maps.append(_tables(basis))
        per_digit.append(maps)
        unit = basis  # 16 times this digit's unit: the next digit's
    return per_digit


def advance(value: int, cells: int) -> int:
    """The CRC register ``value`` through ``cells * _GRID`` zero bytes."""
    if not 0 <= cells < _MAX_CELLS:
        raise ValueError(f"{cells} cells of {_GRID} bytes: advance takes fewer than {_MAX_CELLS}")
    for digit, maps in enumerate(_advance_tables()):
        times = (cells >> (4 * digit)) & 15
        if times:
            value = _apply(maps[times], value)
    return value


class SpanCrc:
    """CRC32C of ``data[start:end]`` for spans at or after ``origin``."""

    def __init__(self, data: bytes, origin: int) -> None:
        self._data = data  # google_crc32c takes bytes, not a memoryview: slices of <= _GRID
        self._origin = origin
        self._grid = array("I", [0])  # [k]: crc32c(data[origin : origin + k * _GRID])

    def _fill(self, index: int) -> None:
        grid = self._grid
        while len(grid) <= index:  # hashed forward, each byte once
            start = self._origin + (len(grid) - 1) * _GRID
            grid.append(google_crc32c.extend(grid[-1], self._data[start : start + _GRID]))

    def crc(self, start: int, end: int) -> int:
        data, origin = self._data, self._origin
        if start < origin or end < start or end > len(data):
            raise ValueError(f"span {start}..{end} is outside {origin}..{len(data)}")
        first = -(-(start - origin) // _GRID)  # the cells the span holds whole
        last = (end - origin) // _GRID
        if last - first < 1:  # within two cells: hashed
            return int(google_crc32c.value(data[start:end]))
        if last >= len(self._grid):
            self._fill(last)
        cells_from = origin + first * _GRID
        cells_to = origin + last * _GRID
        head = int(google_crc32c.value(data[start:cells_from]))
        # crc(a + b) == advance(crc(a), len(b)) ^ crc(b); crc(cells) from the grid
        middle = self._grid[last] ^ advance(self._grid[first] ^ head, last - first)
        return int(google_crc32c.extend(middle, data[cells_to:end]))
