"""The flight data recorder, the alert hooks and the thermal monitor, end to end:
a real ``inferd run`` subprocess, real sockets, a real pymavlink ground station
on loopback, a fake sysfs thermal tree, a real (tiny) full filesystem, and the
recorder read back with ``inferd fdr dump|verify`` after the daemon stopped."""

from __future__ import annotations

import errno
import functools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.fdr.segments import LOCK_NAME
from inferd_client import InferenceClient, OperatorClient
from tests.conftest import REPO, DaemonFactory, Events, wait_until
from tests.conftest import inferctl as shared_inferctl
from tests.integration.wire import IDENTITY_SHAPE

pytestmark = pytest.mark.integration

FALLBACK_CODE = "fallback_to_onnx_trt_ep"
MAV_SEVERITY_WARNING = 4


# -- helpers ---------------------------------------------------------------------------
def image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(IDENTITY_SHAPE, dtype=np.float32)


def infer_once(client: InferenceClient, seed: int) -> dict[str, Any]:
    """One identity inference, checked; returns the reply header."""
    tensor = image(seed)
    np.testing.assert_array_equal(client.infer("identity", {"input": tensor})["output"], tensor)
    return client.last_reply


def run_tool(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=REPO,
    )


def fdr_dump(directory: Path, *kinds: str) -> list[dict[str, Any]]:
    kind_args = [arg for kind in kinds for arg in ("--kind", kind)]
    result = run_tool(
        "-m", "inferd.cli", "fdr", "dump", "--dir", str(directory), "--json", *kind_args
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def fdr_verify(directory: Path) -> subprocess.CompletedProcess[str]:
    return run_tool("-m", "inferd.cli", "fdr", "verify", "--dir", str(directory))


#: ``inferctl(daemon, *args)`` on all the daemon's sockets, each reply awaited 5 s, the
#: whole command 30 s (as ``run_tool``).
inferctl = functools.partial(shared_inferctl, cli_timeout=5, timeout=30)


def identity_model_config(identity_model: Path, **extra: object) -> list[dict[str, object]]:
    return [{"name": "identity", "path": str(identity_model), **extra}]


class FakeThermalZones:
    """A sysfs thermal tree (``thermal_zoneN/{type,temp,trip_point_*}``) whose
    zone numbers are shuffled, so only matching by ``type`` finds the CPU.
    Temperatures are replaced atomically (write + rename): the daemon polls
    the files concurrently and must never read a half-written value."""

    CPU_TRIP_C = 80.0
    GPU_TRIP_C = 90.0
    GPU_C = 50.0

    def __init__(self, root: Path, cpu_c: float, seed: int = 7) -> None:
        self.root = root
        numbers = random.Random(seed).sample(range(12), 4)
        self.cpu = self._zone(
            numbers[0], "cpu-thermal", cpu_c, [("critical", 104.5), ("passive", self.CPU_TRIP_C)]
        )
        self._zone(numbers[1], "gpu-thermal", self.GPU_C, [("passive", self.GPU_TRIP_C)])
        self._zone(numbers[2], "tj-thermal", 60.0, [("critical", 104.5)])
        self._zone(numbers[3], "soc0-thermal", 45.0, [])
        (root / "cooling_device0").mkdir()

    def _zone(
        self, number: int, zone_type: str, temp_c: float, trips: list[tuple[str, float]]
    ) -> Path:
        zone = self.root / f"thermal_zone{number}"
        zone.mkdir(parents=True)
        (zone / "type").write_text(f"{zone_type}\n")
        for index, (trip_type, trip_c) in enumerate(trips):
            (zone / f"trip_point_{index}_type").write_text(f"{trip_type}\n")
            (zone / f"trip_point_{index}_temp").write_text(f"{round(trip_c * 1000)}\n")
        self._write_temp(zone, temp_c)
        return zone

    @staticmethod
    def _write_temp(zone: Path, temp_c: float) -> None:
        staging = zone / ".temp.new"
        staging.write_text(f"{round(temp_c * 1000)}\n")
        os.replace(staging, zone / "temp")

    def set_cpu(self, temp_c: float) -> None:
        self._write_temp(self.cpu, temp_c)


def thermal_config(root: Path, poll_hz: int = 20) -> dict[str, object]:
    return {"sources": ["sysfs"], "sysfs_root": str(root), "poll_hz": poll_hz, "hysteresis_c": 5}


@pytest.fixture
def ground() -> Iterator[Any]:
    """A ground station: a pymavlink ``udpin:`` listener on a free loopback port.

    pymavlink switches its process-wide dialect (and sets ``MAVLINK20``) when a
    connection first sees a MAVLink 2 frame; both are put back afterwards."""
    from pymavlink import mavutil

    saved_env = os.environ.get("MAVLINK20")
    saved = mavutil.current_dialect, mavutil.mavlink
    listener = mavutil.mavlink_connection("udpin:127.0.0.1:0")
    yield listener
    listener.close()
    if saved_env is None:
        os.environ.pop("MAVLINK20", None)
    else:
        os.environ["MAVLINK20"] = saved_env
    mavutil.current_dialect, mavutil.mavlink = saved


def statustexts(listener: Any, quiet_s: float) -> list[Any]:
    """Every STATUSTEXT received until none arrives for ``quiet_s``."""
    messages = []
    while message := listener.recv_match(type="STATUSTEXT", blocking=True, timeout=quiet_s):
        messages.append(message)
    return messages


def reassembled(messages: list[Any]) -> list[tuple[str, set[int]]]:
    """(text, severities) per STATUSTEXT text: ``id = 0`` is one message, a
    non-zero ``id`` joins its chunks in ``chunk_seq`` order (as QGC does)."""
    texts: list[tuple[str, set[int]]] = []
    chunked: dict[int, list[Any]] = {}
    for message in messages:
        if message.id == 0:
            texts.append((message.text, {message.severity}))
        else:
            chunked.setdefault(message.id, []).append(message)
    for chunks in chunked.values():
        chunks.sort(key=lambda chunk: chunk.chunk_seq)
        assert [chunk.chunk_seq for chunk in chunks] == list(range(len(chunks))), chunks
        texts.append(("".join(c.text for c in chunks), {c.severity for c in chunks}))
    return texts


# -- 1. a fallback is recorded and alerted once on every hook ----------------------------
def test_fallback_writes_its_record_and_fires_each_hook_once(
    daemon_factory: DaemonFactory, identity_model: Path, ground: Any
) -> None:
    port = int(ground.port.getsockname()[1])
    daemon = daemon_factory(
        models=identity_model_config(identity_model, runtime="tensorrt"),
        alerts={
            "hooks": ["pub", "fdr", "mavlink"],
            "mavlink_endpoint": f"udpout:127.0.0.1:{port}",
        },
    )
    with Events(daemon.events, topics=["alert"]) as subscriber:
        with InferenceClient(daemon.infer) as client:
            for seed in range(6):
                reply = infer_once(client, seed)
                assert (reply["runtime"], reply["fallback"]) == ("onnx_trt_ep", True)
        first = subscriber.next(lambda _t, p: p["code"] == FALLBACK_CODE, "alert " + FALLBACK_CODE)
        # Every other alert the six requests raised, up to a later marker event.
        later = subscriber.settle()
    assert [p for _t, p in later if p["code"] == FALLBACK_CODE] == [], "alerted more than once"
    assert first["level"] == "WARNING"
    assert first["fields"]["model"] == "identity"

    with OperatorClient(daemon.control) as operator:

        def written_status() -> dict[str, Any] | None:
            status = operator.status()
            return status if status["fdr"].get("records_written", 0) > 0 else None

        status = wait_until(written_status, message="the recorder to write")
    assert status["fdr"]["enabled"] is True
    assert status["fdr"]["records_dropped"] == 0 and status["fdr"]["last_error"] is None
    hooks = status["alerts"]["hooks"]
    assert list(hooks) == ["pub", "fdr", "mavlink"], status["alerts"]
    for name in ("pub", "fdr", "mavlink"):
        assert hooks[name]["sent"] >= 1 and hooks[name]["failures"] == 0, (name, hooks)
    assert status["alerts"]["refused_hooks"] == {}

    # The ground station got it exactly once, as one (chunked) WARNING text.
    messages = statustexts(ground, quiet_s=1.0)
    heads = [m for m in messages if m.text.startswith(FALLBACK_CODE)]
    assert len(heads) == 1, [m.text for m in messages]
    assert heads[0].severity == MAV_SEVERITY_WARNING
    texts = [(text, sev) for text, sev in reassembled(messages) if text.startswith(FALLBACK_CODE)]
    assert texts == [(f"{FALLBACK_CODE}: {first['message']}", {MAV_SEVERITY_WARNING})]
    assert (heads[0].get_srcSystem(), heads[0].get_srcComponent()) == (1, 191)

    assert daemon.stop() == 0, daemon.log()
    # Closing the hooks at shutdown flushes held-back repeats: there must be none.
    after = statustexts(ground, quiet_s=0.3)
    assert not [m.text for m in after if m.text.startswith(FALLBACK_CODE)]
    fdr_dir = daemon.workdir / "state" / "fdr"
    records = fdr_dump(fdr_dir)
    fallbacks = [r for r in records if r["kind"] == FALLBACK_CODE]
    assert len(fallbacks) == 1, records
    payload = fallbacks[0]["payload"]
    assert payload["model"] == "identity"
    assert payload["configured_runtime"] == "tensorrt"
    assert isinstance(payload["reason"], str) and "tensorrt" in payload["reason"].lower()
    assert "CPUExecutionProvider" in payload["active_providers"]

    alerts = [r for r in records if r["kind"] == "alert" and r["payload"]["code"] == FALLBACK_CODE]
    assert len(alerts) == 1, records
    assert alerts[0]["payload"]["level"] == "WARNING"
    assert alerts[0]["payload"]["fields"]["model"] == "identity"
    assert alerts[0]["payload"]["suppressed"] == 0

    lifecycle = [r for r in records if r["kind"] == "daemon_lifecycle"]
    assert [r["payload"]["event"] for r in lifecycle] == ["start", "ready", "stop"]
    start, ready, stop = (r["seq"] for r in lifecycle)
    # Failover happens while the model comes up; the alert at its first request.
    assert start < fallbacks[0]["seq"] < ready < alerts[0]["seq"] < stop
    seqs = [r["seq"] for r in records]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    verified = fdr_verify(fdr_dir)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.startswith("OK")


# -- 2. a thermal excursion is published, served and recorded -------------------------------
def test_thermal_excursion_publishes_transitions_and_records_them(
    daemon_factory: DaemonFactory, identity_model: Path, tmp_path: Path
) -> None:
    zones = FakeThermalZones(tmp_path / "thermal", cpu_c=60.0)
    daemon = daemon_factory(
        models=identity_model_config(identity_model), thermal=thermal_config(zones.root)
    )

    def thermal_event(**expected: object) -> Callable[[str, dict[str, Any]], bool]:
        return lambda topic, p: topic == "thermal" and expected.items() <= p.items()

    with (
        Events(daemon.events, topics=["thermal"]) as subscriber,
        InferenceClient(daemon.infer) as client,
        OperatorClient(daemon.control) as operator,
    ):
        nominal = subscriber.next(thermal_event(available=True), "thermal (available)")
        assert nominal["source"] == "sysfs" and nominal["throttle_active"] is False
        assert (nominal["cpu_temp_c"], nominal["gpu_temp_c"]) == (60.0, zones.GPU_C)
        assert infer_once(client, 1)["thermal"] == "nominal"

        zones.set_cpu(85.0)
        entered = subscriber.next(thermal_event(transition=True), "thermal transition (enter)")
        assert entered["throttle_active"] is True and entered["cpu_temp_c"] == 85.0
        assert infer_once(client, 2)["thermal"] == "throttling"
        described = operator.call("thermal")
        assert described["throttle_active"] is True and described["source"] == "sysfs"
        assert described["available"] is True and described["running"] is True
        assert described["threshold_c"] == zones.CPU_TRIP_C  # the lowest passive trip point
        assert described["last_reading"]["cpu_temp_c"] == 85.0

        shown = inferctl(daemon, "--json", "thermal")
        assert shown.returncode == 0, shown.stdout + shown.stderr
        shown_doc = json.loads(shown.stdout)
        assert shown_doc["source"] == "sysfs" and shown_doc["throttle_active"] is True
        assert shown_doc["threshold_c"] == zones.CPU_TRIP_C
        followed = inferctl(daemon, "--json", "thermal", "--follow", "--count", "2")
        assert followed.returncode == 0, followed.stdout + followed.stderr
        lines = [json.loads(line) for line in followed.stdout.splitlines()]
        assert len(lines) == 2, followed.stdout
        for line in lines:
            assert line["topic"] == "thermal" and line["source"] == "sysfs"
            assert line["throttle_active"] is True and line["cpu_temp_c"] == 85.0

        # Inside the hysteresis band (trip 80, exit at <= 75) throttling holds.
        zones.set_cpu(78.0)
        held = subscriber.next(thermal_event(cpu_temp_c=78.0), "thermal at 78 C")
        assert held["throttle_active"] is True and held["transition"] is False
        assert infer_once(client, 3)["thermal"] == "throttling"

        zones.set_cpu(70.0)
        exited = subscriber.next(thermal_event(transition=True), "thermal transition (exit)")
        assert exited["throttle_active"] is False and exited["cpu_temp_c"] == 70.0
        assert infer_once(client, 4)["thermal"] == "nominal"
        assert operator.call("thermal")["throttle_active"] is False
        assert operator.call("thermal")["transitions"] == 2

    assert daemon.stop() == 0, daemon.log()
    transitions = fdr_dump(daemon.workdir / "state" / "fdr", "thermal_transition")
    assert {r["kind"] for r in transitions} <= {"thermal_transition"}
    assert [
        (
            r["payload"]["throttle_active"],
            r["payload"]["previous"],
            r["payload"]["cpu_temp_c"],
            r["payload"]["gpu_temp_c"],
            r["payload"]["threshold_c"],
            r["payload"]["source"],
        )
        for r in transitions
    ] == [
        (True, False, 85.0, zones.GPU_C, zones.CPU_TRIP_C, "sysfs"),
        (False, True, 70.0, zones.GPU_C, zones.CPU_TRIP_C, "sysfs"),
    ]
    assert [r["payload"]["reason"] for r in transitions] == [
        "temp_at_or_above_enter_threshold",
        "temp_at_or_below_exit_threshold",
    ]


# -- 3. a full disk does not stop serving ------------------------------------------------
TMPFS_BYTES = 64 * 1024


@pytest.fixture
def tiny_tmpfs() -> Iterator[Path]:
    """A 64 KiB tmpfs: a disk that really fills.  Needs root (CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        pytest.skip(
            "mounting a tmpfs needs root; tests/unit/fdr/test_fdr.py covers injected ENOSPC"
        )
    mountpoint = Path(tempfile.mkdtemp(prefix="ifd-full-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0755", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        mountpoint.rmdir()
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.strip()}); "
            "tests/unit/fdr/test_fdr.py covers injected ENOSPC"
        )
    try:
        yield mountpoint
    finally:
        # The test stops its daemon first; if something still holds a file, detach lazily.
        if subprocess.run(["umount", str(mountpoint)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)
        mountpoint.rmdir()


def test_full_disk_drops_records_but_serving_goes_on(
    daemon_factory: DaemonFactory, identity_model: Path, tmp_path: Path, tiny_tmpfs: Path
) -> None:
    fdr_dir = tiny_tmpfs / "fdr"
    fdr_dir.mkdir()
    # Leave one page: the daemon's first records fit, the thermal transitions
    # that follow fill the filesystem for real.
    stats = os.statvfs(tiny_tmpfs)
    filler = tiny_tmpfs / "filler"
    filler.write_bytes(b"\0" * (stats.f_bavail * stats.f_frsize - 4096))
    zones = FakeThermalZones(tmp_path / "thermal", cpu_c=60.0)
    daemon = daemon_factory(
        models=identity_model_config(identity_model),
        fdr={
            "directory": str(fdr_dir),
            "segment_max_bytes": 16384,
            "max_total_bytes": 1024 * 1024,  # far more than the filesystem holds
        },
        thermal=thermal_config(zones.root, poll_hz=50),
    )
    try:
        with (
            Events(daemon.events, topics=["thermal"]) as subscriber,
            InferenceClient(daemon.infer) as client,
            OperatorClient(daemon.control) as operator,
        ):
            hot, toggles = False, 0

            def toggle() -> None:
                """One throttle transition (one critical FDR record), then one request."""
                nonlocal hot, toggles
                hot = not hot
                zones.set_cpu(85.0 if hot else 70.0)
                subscriber.next(
                    lambda _t, p: p["transition"] and p["throttle_active"] is hot,
                    f"thermal transition #{toggles}",
                )
                toggles += 1
                assert infer_once(client, toggles)["ok"] is True

            def fdr_status() -> dict[str, Any]:
                return dict(operator.status()["fdr"])

            subscriber.next(lambda _t, p: p["available"], "thermal (available)")
            assert fdr_status()["records_dropped"] == 0

            # 1. Fill the disk.
            give_up_at = time.monotonic() + 20
            while fdr_status()["records_dropped"] == 0:
                assert time.monotonic() < give_up_at, f"nothing dropped after {toggles} toggles"
                toggle()
            # 2. It stays full while records keep coming, past the writer's retries.
            keep_full_until = time.monotonic() + 2.5
            while time.monotonic() < keep_full_until:
                toggle()
            full = fdr_status()
            health = operator.health()
            assert full["enabled"] is True and full["records_dropped"] > 1, full
            assert "No space left" in (full["last_error"] or ""), full
            assert health["state"] == "serving" and health["threads"]["engine_worker"] is True
            assert sorted(p.name for p in fdr_dir.iterdir()) == [LOCK_NAME, "seg-0000000001.fdr"], (
                "a segment that could not be opened on a full disk is not left behind"
            )
            # 3. Space comes back: the recorder resumes by itself, records keep coming.
            filler.unlink()
            give_up_at = time.monotonic() + 5
            while (resumed := fdr_status())["records_written"] <= full["records_written"]:
                assert time.monotonic() < give_up_at, f"the recorder never resumed: {resumed}"
                toggle()
    finally:
        exit_code = daemon.stop()
    assert exit_code == 0, daemon.log()
    log = daemon.log()
    failures = [line for line in log.splitlines() if "fdr_write_failed" in line]
    assert failures and all("[error" in line for line in failures), log
    assert all(os.strerror(errno.ENOSPC) in line for line in failures), failures
    assert any("[error" in line and "fdr_records_dropped" in line for line in log.splitlines())

    # What reached the disk reads back (a frame cut short by ENOSPC is a torn
    # tail), the gap is marked, and the stop record made it after recovery.
    verified = fdr_verify(fdr_dir)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    records = fdr_dump(fdr_dir)
    lifecycle = [r["payload"]["event"] for r in records if r["kind"] == "daemon_lifecycle"]
    assert lifecycle == ["start", "ready", "stop"], records
    (dropped,) = [r["payload"] for r in records if r["kind"] == "fdr_dropped"]
    assert dropped["dropped"] == resumed["records_dropped"], (dropped, resumed)
    assert "No space left" in dropped["reason"], dropped
    transitions = [r for r in records if r["kind"] == "thermal_transition"]
    assert 0 < len(transitions) < toggles


# -- 4. an unusable recorder directory does not stop serving ---------------------------------
def test_unusable_fdr_directory_serves_without_the_recorder(
    daemon_factory: DaemonFactory, identity_model: Path, tmp_path: Path
) -> None:
    not_a_directory = tmp_path / "fdr-is-a-file"
    not_a_directory.write_text("not a directory\n")
    daemon = daemon_factory(
        models=identity_model_config(identity_model), fdr={"directory": str(not_a_directory)}
    )
    with InferenceClient(daemon.infer) as client:
        for seed in range(3):
            assert infer_once(client, seed)["ok"] is True
    with OperatorClient(daemon.control) as operator:
        status = operator.status()
        health = operator.health()
    assert set(status["fdr"]) == {"enabled", "error"}, status["fdr"]
    assert status["fdr"]["enabled"] is False
    assert "cannot start the flight data recorder" in status["fdr"]["error"]
    assert str(not_a_directory) in status["fdr"]["error"]
    assert health["state"] == "serving"
    assert daemon.stop() == 0, daemon.log()
    assert "fdr_unavailable" in daemon.log()
    assert not_a_directory.read_text() == "not a directory\n"


def test_a_start_that_fails_after_the_recorder_started_is_a_durable_record(
    short_tmp_path: Path, identity_model: Path
) -> None:
    """A socket that cannot be bound (its port taken): the process exits 1, and its
    flight data recorder holds the start and why it failed (no record lost at exit)."""
    from inferd.fdr.reader import read_records
    from tests.conftest import render_config

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = short_tmp_path / "inferd.toml"
        config.write_text(
            render_config(
                short_tmp_path,
                [{"name": "identity", "path": str(identity_model)}],
                bus={"events_endpoint": f"tcp://127.0.0.1:{port}"},
            )
        )
        done = subprocess.run(
            [sys.executable, "-m", "inferd.cli", "run", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    assert done.returncode == 1, done.stderr
    assert "cannot start: Address already in use" in done.stderr
    records = list(read_records(short_tmp_path / "state" / "fdr", kinds=("daemon_lifecycle",)))
    assert [record.payload["event"] for record in records] == ["start", "start_failed"]
    assert "Address already in use" in records[1].payload["error"]
