"""Second review of the ``inferd`` command: ``fdr`` output from hostile (or merely
unusual) recorder files, ``build --timeout``/``--stall-after`` values no timer can
wait, and ``keys`` allow-listing a key the daemon then refuses to start with."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd import config
from inferd.bus.curve_keys import load_curve
from inferd.cli import build as tensorrt_cli
from inferd.cli import fdr as fdr_cli
from inferd.cli.main import main
from inferd.config import FdrConfig
from inferd.fdr.framing import encode_body, encode_frame, encode_segment_header, segment_name
from inferd.fdr.writer import FlightRecorder
from inferd_wire.curve import CurveKeyError
from tests.tensorrt_bench import Bench


def strict_json(line: str) -> Any:
    """What any JSON parser (jq, JavaScript, Go) reads: no NaN, no Infinity."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def recorder_with_non_finite_floats(directory: Path) -> Path:
    """What the daemon's own recorder writes: it takes NaN and infinities."""
    writer = FlightRecorder(FdrConfig(directory=directory))
    writer.start()
    writer.record("deadline_miss", {"model": "a", "count": 1, "window_s": math.nan})
    writer.record("deadline_miss", {"model": "b", "count": 2, "window_s": [math.inf, -math.inf]})
    writer.stop()
    return directory


def hostile_recorder(directory: Path, payloads: list[tuple[str, Any]]) -> Path:
    """One segment of CRC-valid records with any kind and payload."""
    directory.mkdir()
    data = encode_segment_header(1, 0)
    for seq, (kind, payload) in enumerate(payloads, 1):
        body = {
            "kind": kind,
            "schema_version": 1,
            "seq": seq,
            "wall_ns": 1_700_000_000_000_000_000,
            "mono_ns": seq,
            "boot_id": "b",
            "payload": payload,
        }
        data += encode_frame(encode_body(body))
    (directory / segment_name(1)).write_bytes(data)
    return directory


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


# -- fdr: JSON output is JSON -------------------------------------------------------------------


def test_dump_json_writes_nan_and_infinities_as_null(tmp_path: Path) -> None:
    fdr = recorder_with_non_finite_floats(tmp_path / "fdr")
    out = io.StringIO()
    assert fdr_cli.dump(fdr, kinds=[], since_wall_ns=None, as_json=True, out=out) == 0
    lines = out.getvalue().splitlines()
    payloads = [strict_json(line)["payload"] for line in lines]
    assert payloads == [
        {"model": "a", "count": 1, "window_s": None},
        {"model": "b", "count": 2, "window_s": [None, None]},
    ]


def test_export_mcap_messages_are_json_without_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mcap")
    from mcap.reader import make_reader

    fdr = recorder_with_non_finite_floats(tmp_path / "fdr")
    out = tmp_path / "flight.mcap"
    assert main(["fdr", "export", "--dir", str(fdr), "--mcap", str(out)]) == 0
    with out.open("rb") as stream:
        messages = [m.data for _s, _c, m in make_reader(stream).iter_messages()]
    assert [strict_json(data.decode())["window_s"] for data in messages] == [None, [None, None]]


# -- fdr: a payload nested deeper than the recorder writes --------------------------------------


def test_a_payload_nested_deeper_than_the_recorder_writes_is_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """msgpack reads 1,020 levels; json.dumps raised RecursionError on them.  The
    reader now calls such a frame corruption itself (``fdr/reader.py``), so the
    commands skip and count it as any other."""
    fdr = hostile_recorder(
        tmp_path / "fdr",
        [("deadline_miss", {"x": nested(1020)}), ("deadline_miss", {"model": "ok"})],
    )
    for json_flag in ([], ["--json"]):
        assert main(["fdr", "dump", "--dir", str(fdr), *json_flag]) == 0
        captured = capsys.readouterr()
        assert len(captured.out.splitlines()) == 1 and "ok" in captured.out
        assert "1 corrupt region(s)" in captured.err
    assert main(["fdr", "verify", "--dir", str(fdr), "--json"]) == 1
    (corrupt,) = strict_json(capsys.readouterr().out)["corrupt"]
    assert "payload nested deeper than 511 levels" in corrupt["reason"]
    pytest.importorskip("mcap")
    out = tmp_path / "x.mcap"
    assert main(["fdr", "export", "--dir", str(fdr), "--mcap", str(out)]) == 0
    assert "wrote 1 record(s)" in capsys.readouterr().err


def test_what_the_recorder_may_write_is_shown(tmp_path: Path) -> None:
    fdr = hostile_recorder(tmp_path / "fdr", [("deadline_miss", {"x": nested(510)})])
    out = io.StringIO()
    assert fdr_cli.dump(fdr, kinds=[], since_wall_ns=None, as_json=True, out=out) == 0
    assert len(out.getvalue().splitlines()) == 1
    assert fdr_cli.verify(fdr, as_json=False, out=io.StringIO()) == 0


# -- fdr: a record's text cannot forge lines or drive the terminal ------------------------------


def test_dump_quotes_a_kind_or_key_with_control_characters(tmp_path: Path) -> None:
    forged = "deadline_miss\n2026-01-01T00:00:00.000Z  seq=99       alert  forged=1"
    fdr = hostile_recorder(
        tmp_path / "fdr",
        [(forged, {"model": "a"}), ("\x1b[2Jalert", {"key\x1b]0;title\x07": 1})],
    )
    buffer = io.StringIO()
    assert fdr_cli.dump(fdr, kinds=[], since_wall_ns=None, as_json=False, out=buffer) == 0
    out = buffer.getvalue()
    assert len(out.splitlines()) == 2
    assert "\x1b" not in out and "\x07" not in out
    assert '"\\u001b[2Jalert"' in out


# -- build: timeouts a timer can wait ----------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, 1e300])
@pytest.mark.parametrize("option", ["timeout_s", "stall_after_s"])
def test_a_build_timeout_no_timer_can_wait_is_a_usage_error_before_building(
    bench: Bench, demo_model: Path, option: str, value: float
) -> None:
    """NaN passed ``<= 0``: a NaN ``--timeout`` cancelled the build at once (exit 3), a
    NaN ``--stall-after`` never fired; inf and 1e300 killed the timer's thread
    (OverflowError) and the build ran with no timeout at all (exit 0)."""
    err = io.StringIO()
    code = tensorrt_cli.run(
        demo_model, engine_dir=bench.engine_dir, err=err, out=io.StringIO(), **{option: value}
    )
    flag = "--timeout" if option == "timeout_s" else "--stall-after"
    assert code == tensorrt_cli.EXIT_USAGE, err.getvalue()
    assert f"{flag} must be" in err.getvalue()
    assert bench.gpu.trt.builds == 0


def test_a_day_is_still_a_timeout(bench: Bench, demo_model: Path) -> None:
    out = io.StringIO()
    code = tensorrt_cli.run(
        demo_model, engine_dir=bench.engine_dir, timeout_s=86_400.0, out=out, err=io.StringIO()
    )
    assert code == 0 and bench.gpu.trt.builds == 1


# -- keys: what is allow-listed is what the daemon starts with ---------------------------------


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "inferd.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[security]\ncurve = true\n'
        '[[models]]\nname = "demo"\npath = "demo.onnx"\n'
    )
    return path


def allow(config_path: Path, name: str, key: str, *extra: str) -> int:
    return main(["keys", "allow", "--config", str(config_path), *extra, name, "--", key])


def test_allowing_a_key_already_allow_listed_under_another_name_is_refused(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon refuses to start on two names for one key ("is the same key as")."""
    assert main(["keys", "init", "--config", str(config_path)]) == 0
    public, _ = zmq.curve_keypair()
    assert allow(config_path, "ground", public.decode()) == 0
    capsys.readouterr()
    assert allow(config_path, "other", public.decode()) == 1
    assert "is allow-listed already as 'ground'" in capsys.readouterr().err
    security = config.load(config_path).security
    assert not (security.curve_clients_dir / "other.key").exists()
    assert sorted(load_curve(security).clients.values()) == ["ground"]  # the daemon starts
    # the same name again, with --force, is a replacement, not a second name
    assert allow(config_path, "ground", public.decode(), "--force") == 0


def test_allowing_into_a_clients_dir_the_daemon_refuses_says_why(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keys", "init", "--config", str(config_path)]) == 0
    clients = config.load(config_path).security.curve_clients_dir
    clients.mkdir(mode=0o750)
    (clients / "broken.key").write_text("not a certificate")
    public, _ = zmq.curve_keypair()
    assert allow(config_path, "ground", public.decode()) == 1
    assert "broken.key" in capsys.readouterr().err
    assert not (clients / "ground.key").exists()
    with pytest.raises(CurveKeyError):
        load_curve(config.load(config_path).security)
