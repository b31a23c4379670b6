"""``inferctl infer --save`` and ``--json`` after review R2 of DESIGN.md 319 (F3, F4).

F3: ``--save`` writes a new file beside the path and renames it over the path
(319).  Over a file already there it took 0666 less the umask (a 0600 file
became 0644); through a symlink it replaced the link by a file and left the
file the link named as it was; and an error named the temporary file
(``/proc/self/fd/.1.f2a2….tmp``), a path the user never gave.  ``open("wb")``,
before 319, kept the file's mode and wrote through the link.

F4: ``--json`` wrote a msgpack ``bin`` map key as the hex of its bytes, so a bin
key and a str key spelling that hex (``{b"ab": 1, "6162": 2}``) came out as one
entry: the other was lost without a word."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd_client import cli
from inferd_client.cli_output import json_line
from inferd_client.errors import ClientError, MalformedReply
from tests.conftest import HANG_S, REPO
from tests.unit.client.scripted import Script
from tests.unit.client.test_review3_client_cli import NAMES, infer_saving, with_outputs

OUTPUTS: dict[str, np.ndarray] = {"y": np.arange(3, dtype=np.float32), "file": np.ones(2, np.int8)}


def saved(path: Path) -> dict[str, list[float]]:
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name].tolist() for name in archive.files}


def refuse_opens(monkeypatch: pytest.MonkeyPatch, refused: Callable[[Path, int], object]) -> None:
    """``os.open`` fails with ``EACCES`` where ``refused(path, flags)`` is true, as the
    kernel answers another user for a file or directory it may not write (the tests
    may run as root, whom no mode stops)."""
    real_open = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if refused(Path(path), flags):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o604])
def test_save_over_a_file_keeps_its_mode(tmp_path: Path, mode: int) -> None:
    target = tmp_path / "out.npz"
    target.write_bytes(b"what was there")
    target.chmod(mode)
    umask = os.umask(0o022)
    try:
        cli._save_npz(target, OUTPUTS)
    finally:
        os.umask(umask)
    assert target.stat().st_mode & 0o7777 == mode
    assert saved(target) == {"y": [0.0, 1.0, 2.0], "file": [1, 1]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npz"]


def test_save_through_a_symlink_writes_the_file_it_names(tmp_path: Path) -> None:
    real = tmp_path / "data" / "real.npz"
    real.parent.mkdir()
    real.write_bytes(b"what was there")
    real.chmod(0o600)
    link = tmp_path / "link.npz"
    link.symlink_to(Path("data") / "real.npz")  # relative, as links often are
    cli._save_npz(link, OUTPUTS)
    assert link.is_symlink() and os.readlink(link) == str(Path("data") / "real.npz")
    assert saved(real)["y"] == [0.0, 1.0, 2.0]
    assert real.stat().st_mode & 0o7777 == 0o600
    # Nothing left beside the link or the file.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "link.npz"]
    assert [p.name for p in real.parent.iterdir()] == ["real.npz"]


def test_save_through_a_dangling_symlink_makes_the_file_it_names(tmp_path: Path) -> None:
    link = tmp_path / "link.npz"
    link.symlink_to(tmp_path / "made.npz")
    cli._save_npz(link, OUTPUTS)
    assert link.is_symlink()
    assert saved(tmp_path / "made.npz")["file"] == [1, 1]


def test_save_to_what_is_not_a_regular_file_writes_into_it(tmp_path: Path) -> None:
    # A pipe (here the child's stdout, by /proc/self/fd/1: never /dev/stdout or a
    # device, which the code before this test replaced by a file when run as root):
    # nothing can be renamed over it; it is written as open() writes it, and
    # np.load reads what came through.
    script = (
        "import sys, numpy as np; from pathlib import Path; from inferd_client import cli; "
        "cli._save_npz(Path('/proc/self/fd/1'), "
        "{'y': np.arange(3, dtype=np.float32), 'file': np.ones(2, np.int8)})"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        timeout=HANG_S,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "clients")},
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    (tmp_path / "piped.npz").write_bytes(done.stdout)
    assert saved(tmp_path / "piped.npz") == {"y": [0.0, 1.0, 2.0], "file": [1, 1]}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes any file and directory")
def test_save_refuses_a_file_it_may_not_write_as_open_did(tmp_path: Path) -> None:
    target = tmp_path / "out.npz"
    target.write_bytes(b"what was there")
    target.chmod(0o444)
    with pytest.raises(ClientError, match=f"cannot save the outputs to {target}: "):
        cli._save_npz(target, OUTPUTS)
    assert target.read_bytes() == b"what was there"


def test_save_refuses_a_file_the_kernel_will_not_open_for_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As root the kernel opens any file: its answer for another user's read-only
    # file (EACCES) is given here by os.open, which the rename never asked.
    target = tmp_path / "out.npz"
    target.write_bytes(b"what was there")
    refuse_opens(
        monkeypatch,
        lambda path, flags: path == target and flags & os.O_WRONLY and not flags & os.O_CREAT,
    )
    with pytest.raises(ClientError) as refused:
        cli._save_npz(target, OUTPUTS)
    assert str(refused.value) == f"cannot save the outputs to {target}: Permission denied"
    assert target.read_bytes() == b"what was there"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npz"]


def test_save_over_a_file_in_a_directory_it_may_not_write_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # open("wb") would have written the file; the rename needs a new file beside it.
    target = tmp_path / "out.npz"
    target.write_bytes(b"what was there")
    refuse_opens(monkeypatch, lambda path, flags: path.parent == tmp_path and flags & os.O_CREAT)
    with pytest.raises(ClientError) as refused:
        cli._save_npz(target, OUTPUTS)
    assert str(refused.value) == (
        f"cannot save the outputs to {target}: no new file can be made in {tmp_path} "
        "(Permission denied)"
    )
    assert target.read_bytes() == b"what was there"


def test_an_error_names_the_path_given_never_the_file_beside_it(
    server: Callable[[Script], str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no such dir" / "out.npz"
    assert infer_saving(server(with_outputs(NAMES)), tmp_path, missing) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"cannot save the outputs to {missing}: No such file or directory" in err, err
    assert ".tmp" not in err, err


def test_json_marks_a_bin_key_so_no_str_key_takes_its_place() -> None:
    shown = json.loads(json_line({"m": {b"ab": 1, "6162": 2}}))
    assert shown == {"m": {"hex:6162": 1, "6162": 2}}


def test_json_marks_a_bin_value_as_its_key() -> None:
    shown = json.loads(json_line({"a": {b"\x00k": [b"", b"\x01\xff", "01ff", 1.5]}}))
    assert shown == {"a": {"hex:006b": ["hex:", "hex:01ff", "01ff", 1.5]}}


def test_json_refuses_a_map_whose_bin_key_reads_as_one_of_its_str_keys() -> None:
    # Two keys that would be one: never one of them dropped without a word.
    with pytest.raises(MalformedReply, match="hex:6162"):
        json_line({"m": {b"ab": 1, "hex:6162": 2}})
