"""``inferd fdr``'s arguments and the errors it reports instead of tracebacks: an
unusable ``--mcap`` path, a ``--since`` with no nanosecond form, a recorder
directory that cannot be listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.cli.fdr import parse_since
from inferd.cli.main import main
from inferd.fdr import reader
from tests.conftest import written_recorder


@pytest.mark.parametrize(
    ("target", "message"),
    [("missing-dir/out.mcap", "is in no directory"), ("a-directory", "is a directory")],
)
def test_export_to_an_unusable_mcap_path_is_a_usage_error_leaving_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, message: str
) -> None:
    pytest.importorskip("mcap")
    fdr = written_recorder(tmp_path / "fdr", 5)
    (tmp_path / "a-directory").mkdir()
    before = sorted(tmp_path.rglob("*"))
    assert main(["fdr", "export", "--dir", str(fdr), "--mcap", str(tmp_path / target)]) == 2
    assert message in capsys.readouterr().err
    assert sorted(tmp_path.rglob("*")) == before


def test_export_that_cannot_write_exits_1_and_removes_its_temp_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure while writing (a full disk, here a failing fsync) is a clear error."""
    pytest.importorskip("mcap")
    import os

    fdr = written_recorder(tmp_path / "fdr", 5)
    out = tmp_path / "out"
    out.mkdir()

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    assert main(["fdr", "export", "--dir", str(fdr), "--mcap", str(out / "x.mcap")]) == 1
    assert f"inferd: cannot write {out / 'x.mcap'}: No space left on device" in (
        capsys.readouterr().err
    )
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("since", ["inf", "-inf", "nan", "1e400", "1e300", "9" * 400 + "d"])
def test_since_without_a_nanosecond_form_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], since: str
) -> None:
    fdr = written_recorder(tmp_path / "fdr", 5)
    for command in ("dump", "export"):
        args = ["fdr", command, "--dir", str(fdr), f"--since={since}"]
        assert (
            main([*args, "--mcap", str(tmp_path / "x.mcap")] if command == "export" else args) == 2
        )
        assert f"--since {since!r} is out of range" in capsys.readouterr().err


def test_since_far_but_finite_still_parses() -> None:
    assert parse_since("1e20") == int(1e29)
    assert parse_since("1000000d", now_ns=0) == -int(86_400e15)


def test_a_recorder_directory_that_cannot_be_listed_exits_1_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fdr = written_recorder(tmp_path / "fdr", 5)

    def refused(directory: Path) -> list[Path]:  # as os.scandir on a 0700 dir of another user
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(reader, "list_segments", refused)
    for command in (["dump"], ["verify"], ["export", "--mcap", str(tmp_path / "x.mcap")]):
        assert main(["fdr", command[0], "--dir", str(fdr), *command[1:]]) == 1
        err = capsys.readouterr().err
        assert (
            f"inferd: cannot read the recorder directory: [Errno 13] Permission denied: '{fdr}'"
            in err
        )
    assert not (tmp_path / "x.mcap").exists()
