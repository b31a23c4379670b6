"""``inferctl infer --npy`` checks numpy's magic string itself (DESIGN.md 176): a
regular file that is no .npy file (a text file, a pickle, a file too short to
hold the magic) is said to be one, naming its ``--npy``, in place of numpy's
words about its header."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from inferd_client.cli_inputs import load_npy


@pytest.mark.parametrize(
    "content",
    [b"not an array at all\n", pickle.dumps([1.0, 2.0]), b"\x93NU"],
    ids=["text", "pickle", "short"],
)
def test_a_file_without_the_npy_magic_is_said_to_be_no_npy_file(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "input.npy"
    path.write_bytes(content)
    item = f"image={path}"
    with pytest.raises(ValueError) as refused:
        load_npy([item])
    message = str(refused.value)
    assert message.startswith(f"--npy {item}: not an .npy file"), message
    assert "magic string" not in message and "EOF" not in message  # numpy's words
