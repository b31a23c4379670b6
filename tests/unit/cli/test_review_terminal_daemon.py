"""``inferd``'s own terminal output shows no control character it was given:
``inferd build``'s progress (phase names come from the build: TensorRT, a model's
ONNX file) and its report (paths), through ``inferd_client.cli_format.printable``;
``inferd fdr dump`` quotes a record's strings as JSON (a client's ``requested_by``
is recorded as it sent it), and ``--json`` stays exact."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from inferd.cli import build_report
from inferd.cli.build_progress import LiveProgress, PlainProgress
from inferd.cli.main import main
from inferd.config import FdrConfig
from inferd.engine_build.events import BuildEvent
from inferd.fdr.framing import encode_body, encode_frame, encode_segment_header, segment_name
from inferd.fdr.writer import FlightRecorder
from inferd.types import BuildConfig

HOSTILE = "x\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\r\nforged\x9b1m\u202e"


def raw_controls(shown: str) -> list[str]:
    return [char for char in shown if not char.isprintable() and char != "\n"]


def event(kind: str, name: str, **detail: Any) -> BuildEvent:
    return BuildEvent(
        build_id="b1",
        seq=1,
        type=kind,
        phase_id="p1",
        parent_id=None,
        name=name,
        step=None,
        num_steps=3,
        mono_ns=0,
        wall_ns=0,
        thread="t",
        cancel_state="none",
        detail=detail,
    )


def test_plain_progress_shows_a_phase_name_escaped() -> None:
    stream = io.StringIO()
    progress = PlainProgress(stream)
    progress(event("phase_start", HOSTILE))
    progress(event("phase_finish", HOSTILE))
    progress(event("cancel_requested", "c", source=HOSTILE))
    shown = stream.getvalue()
    assert raw_controls(shown) == [] and shown.count("\n") == 3
    assert "start     x\\x1b]52;c;" in shown


def test_live_progress_shows_a_phase_name_escaped() -> None:
    progress = LiveProgress(io.StringIO(), "inferd build " + HOSTILE)
    try:
        progress(event("phase_start", HOSTILE))
        console = Console(file=io.StringIO(), width=200, color_system=None)
        console.print(progress._render())
    finally:
        progress.close()
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert raw_controls(shown) == [] and shown.count("x\\x1b]52;c;") == 2


def test_the_build_report_shows_paths_escaped(tmp_path: Path) -> None:
    engine = tmp_path / f"model{HOSTILE}.engine"
    host = SimpleNamespace(describe=lambda: {}, summary=lambda: "sm87 " + HOSTILE)
    outcome = SimpleNamespace(
        entry=SimpleNamespace(artifact_path=engine),
        status="reused",
        engine_name=SimpleNamespace(host=host),
        quarantined=tmp_path / HOSTILE,
    )
    out = io.StringIO()
    code = build_report.report_outcome(
        outcome,  # type: ignore[arg-type]
        None,
        "ab" * 32,
        0,
        succeeded=True,
        wanted=BuildConfig(),
        manifest=None,
        not_shown=0,
        as_json=False,
        out=out,
    )
    shown = out.getvalue()
    assert code == 0 and raw_controls(shown) == []
    assert "modelx\\x1b]52;c;" in shown and len(shown.splitlines()) == 5


@pytest.fixture
def hostile_recorder(tmp_path: Path) -> Path:
    """A recorder holding one switch record whose ``requested_by`` (what a client
    claims) is hostile, under a hostile key too."""
    writer = FlightRecorder(FdrConfig(directory=tmp_path / "fdr"))
    writer.start()
    payload = {
        "model": "m",
        "from_runtime": "onnx_trt_ep",
        "to_runtime": "tensorrt",
        "requested_by": HOSTILE,
        "outcome": "refused",
        "reason": "no engine",
        HOSTILE: 1,
    }
    writer.record("runtime_switch", payload)
    writer.stop()
    return tmp_path / "fdr"


def test_fdr_dump_quotes_a_hostile_string(
    hostile_recorder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fdr", "dump", "--dir", str(hostile_recorder)]) == 0
    out = capsys.readouterr().out
    assert raw_controls(out) == [] and out.count("\n") == 1
    assert '"x\\u001b]52;c;cm0gLXJmIH4=\\u0007' in out
    assert main(["fdr", "dump", "--dir", str(hostile_recorder), "--json"]) == 0
    out = capsys.readouterr().out
    assert raw_controls(out) == []
    assert json.loads(out)["payload"]["requested_by"] == HOSTILE


def test_fdr_export_names_a_hostile_kind_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A recording copied from elsewhere may hold any kind (the reader takes any
    string): the export's summary on stderr names it escaped."""
    pytest.importorskip("mcap")
    fdr = tmp_path / "fdr"
    fdr.mkdir()
    body = {
        "kind": "odd" + HOSTILE,
        "schema_version": 1,
        "seq": 1,
        "wall_ns": 1,
        "mono_ns": 1,
        "boot_id": "b",
        "payload": {"x": 1},
    }
    (fdr / segment_name(0)).write_bytes(
        encode_segment_header(0, 0) + encode_frame(encode_body(body))
    )
    assert main(["fdr", "export", "--dir", str(fdr), "--mcap", str(tmp_path / "o.mcap")]) == 0
    err = capsys.readouterr().err
    assert raw_controls(err) == [] and "oddx\\x1b]52;c;" in err
