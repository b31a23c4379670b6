"""A long alert message is cut before it is transliterated, with the same result.

``statustext_chunks`` ran NFKD and the transliteration over the whole text, then
cut it to 199 characters: 118 ms for a 1 MB message (11 ms for 100 kB) on the
thread that raised the alert, which may be the engine worker.  It now
transliterates a slice at a time, only until it has more than the budget.
"""

from __future__ import annotations

import random
import socket
import unicodedata
from collections.abc import Callable

import pytest

from inferd.alerts.mavlink import (
    MAX_CHUNKS_LIMIT,
    STATUSTEXT_LEN,
    MavlinkAlertHook,
    statustext_chunks,
)

#: A megabyte of message, as untrusted exception text can be.
LONG = 1_000_000
#: Characters a slice-wise transliteration may look at for a 4-chunk budget: a
#: slice or two of 200 (the budget plus one); the whole text is far beyond.
MOST_NORMALISED = 1_000


def _reference(text: str, suffix: str, max_chunks: int) -> list[bytes]:
    """The rule as it was: transliterate all of ``text``, then cut."""

    def printable(value: str) -> str:
        out = []
        for char in unicodedata.normalize("NFKD", value):
            if unicodedata.combining(char):
                continue
            out.append(" " if char in "\t\r\n" else char if " " <= char <= "~" else "?")
        return "".join(out)

    body, tail = printable(text).encode(), printable(suffix).encode()
    data = body + tail
    if len(data) <= STATUSTEXT_LEN:
        return [data]
    limit = STATUSTEXT_LEN if max_chunks == 1 else STATUSTEXT_LEN * max_chunks - 1
    if len(data) > limit:
        keep = max(limit - len(tail) - 3, 0)
        data = (body[:keep].rstrip() + b"..." + tail)[:limit]
    if len(data) <= STATUSTEXT_LEN:
        return [data]
    if len(data) % STATUSTEXT_LEN == 0:
        data += b" "
    return [data[start : start + STATUSTEXT_LEN] for start in range(0, len(data), STATUSTEXT_LEN)]


@pytest.fixture
def normalised(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every text handed to ``unicodedata.normalize``."""
    lengths: list[int] = []
    real: Callable[[str, str], str] = unicodedata.normalize

    def counting(form: str, text: str) -> str:
        lengths.append(len(text))
        return real(form, text)

    monkeypatch.setattr(unicodedata, "normalize", counting)
    return lengths


def test_a_megabyte_message_is_cut_before_it_is_transliterated(normalised: list[int]) -> None:
    chunks = statustext_chunks("model_unavailable: " + "e\u0301" * LONG, suffix=" (+3 repeats)")
    assert max(normalised) <= MOST_NORMALISED, f"normalised {max(normalised)} characters"
    joined = b"".join(chunks).decode()
    assert len(joined) == 4 * STATUSTEXT_LEN - 1
    assert joined.startswith("model_unavailable: eee") and joined.endswith("e... (+3 repeats)")


def test_the_hook_transliterates_no_more_of_a_long_message(
    normalised: list[int], udp_listener: socket.socket
) -> None:
    hook = MavlinkAlertHook(f"udpout:127.0.0.1:{udp_listener.getsockname()[1]}")
    try:
        hook.alert("ERROR", "model_unavailable", "caf\u00e9 " * (LONG // 5), {})
        first = udp_listener.recv(512)
    finally:
        hook.close()
    assert max(normalised) <= MOST_NORMALISED, f"normalised {max(normalised)} characters"
    assert b"model_unavailable: cafe cafe" in first


#: Characters whose transliteration is not one for one: combining marks (none),
#: ligatures and U+FDFA (several), wide and astral ones ("?"), controls.
ALPHABET = "ab c\u0301\u0308\ufb01\ufdfa\u00e9\u65e5\U0001f600\n\t\x00~\u1e9b\u0323"


@pytest.mark.parametrize("seed", range(3))
def test_cutting_first_gives_what_transliterating_everything_gave(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 700)))
        if rng.random() < 0.3:  # runs of marks, which transliterate to nothing
            text = text[:50] + "\u0301" * rng.randrange(0, 500) + text[50:]
        suffix = rng.choice(["", " (+2 repeats)", " (3 s late)", " (+1 repeats) (61 s late)"])
        max_chunks = rng.choice([1, 2, 3, 4, 5, MAX_CHUNKS_LIMIT])
        expected = _reference(text, suffix, max_chunks)
        assert statustext_chunks(text, suffix=suffix, max_chunks=max_chunks) == expected, (
            text,
            suffix,
            max_chunks,
        )
