"""What the ``inferd`` command promises a person and a script (issue "install, CLI,
metrics", part 2): ``--version`` is the one version; offline subcommands log to
stderr, so stdout is their result alone; ``| head`` ends quietly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import inferd_wire
from tests.conftest import REPO, written_recorder

pytestmark = pytest.mark.integration


def inferd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferd.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_version_is_the_one_version() -> None:
    result = inferd("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"inferd {inferd_wire.__version__}")


def test_fdr_dump_json_is_json_only_and_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    written_recorder(tmp_path / "fdr", 2000)
    dumped = inferd("fdr", "dump", "--json", "--dir", str(tmp_path / "fdr"))
    assert dumped.returncode == 0, dumped.stderr
    records = [json.loads(line) for line in dumped.stdout.splitlines()]  # every line is JSON
    assert len(records) >= 2000
    reader = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli", "fdr", "dump", "--dir", str(tmp_path / "fdr")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert reader.stdout is not None and reader.stderr is not None
    assert reader.stdout.readline()  # like `| head -1`
    reader.stdout.close()
    assert reader.wait(timeout=60) == 0
    assert reader.stderr.read() == b""  # no BrokenPipeError traceback


def test_inferd_verify_json_is_json_only(tmp_path: Path) -> None:
    engine = tmp_path / "not-an-engine.engine"
    engine.write_bytes(b"x")
    result = inferd("verify", str(engine), "--json")
    json.loads(result.stdout)  # the report and nothing else, whatever it says


def write_old_segment(directory: Path) -> None:
    """A segment as a recorder before the rename wrote it: kinds named ``c7.<name>``,
    and a ``cpu_fallback`` record (a kind since replaced by ``provider_degraded``)."""
    from inferd.fdr import framing

    directory.mkdir(parents=True)
    records = [
        ("c7.deadline_miss", {"model": "demo", "count": 3, "window_s": 10.0}),
        ("c7.cpu_fallback", {"model": "demo", "requested": ["CUDAExecutionProvider"]}),
    ]
    frames = b"".join(
        framing.encode_frame(
            framing.encode_body(
                {
                    "kind": kind,
                    "schema_version": 1,
                    "seq": seq,
                    "wall_ns": 1_790_000_000_000_000_000 + seq,
                    "mono_ns": seq,
                    "boot_id": "old-boot",
                    "payload": payload,
                }
            )
        )
        for seq, (kind, payload) in enumerate(records, start=1)
    )
    (directory / framing.segment_name(1)).write_bytes(
        framing.encode_segment_header(1, 1_790_000_000_000_000_000) + frames
    )


def test_old_recorder_files_read_with_todays_names_and_an_unknown_kind_is_refused(
    tmp_path: Path,
) -> None:
    write_old_segment(tmp_path / "fdr")
    for asked in ("deadline_miss", "c7.deadline_miss"):
        dumped = inferd("fdr", "dump", "--json", "--dir", str(tmp_path / "fdr"), "--kind", asked)
        assert dumped.returncode == 0, dumped.stderr
        (record,) = [json.loads(line) for line in dumped.stdout.splitlines()]
        assert record["kind"] == "deadline_miss" and record["payload"]["count"] == 3
    human = inferd("fdr", "dump", "--dir", str(tmp_path / "fdr")).stdout
    assert "deadline_miss" in human and "model=demo count=3 window_s=10.0" in human
    assert "c7." not in human and "'" not in human  # no prefix, no Python repr
    refused = inferd("fdr", "dump", "--dir", str(tmp_path / "fdr"), "--kind", "deadline_mis")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "'deadline_mis' is no record kind; did you mean deadline_miss?" in refused.stderr
    # A kind only earlier versions wrote is still one to filter by.
    retired = inferd(
        "fdr", "dump", "--json", "--dir", str(tmp_path / "fdr"), "--kind", "cpu_fallback"
    )
    assert retired.returncode == 0, retired.stderr
    (record,) = [json.loads(line) for line in retired.stdout.splitlines()]
    assert record["kind"] == "cpu_fallback" and record["payload"]["model"] == "demo"
    unknown = inferd("fdr", "dump", "--dir", str(tmp_path / "fdr"), "--kind", "zzzzzz")
    assert unknown.returncode == 2 and "is no record kind. Known: [" in unknown.stderr
