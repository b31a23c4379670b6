"""The metrics exposition of a real daemon, scraped over HTTP as Prometheus does
and read from its node_exporter textfile: the values agree with ``status``, the
endpoint is bounded, and it is off unless configured."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from inferd_client import InferenceClient, OperatorClient, RemoteError
from tests.conftest import DaemonFactory, DaemonProcess, wait_until

pytestmark = pytest.mark.integration

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
IDENTITY = (1, 3, 224, 224)


def _status(daemon: DaemonProcess) -> dict[str, Any]:
    with OperatorClient(daemon.control, timeout=10) as operator:
        return operator.status()


def _scrape(listen: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(f"http://{listen}/metrics")
    if accept:
        request.add_header("Accept", accept)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode(), response.headers["Content-Type"]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _listening_tcp_ports(pid: int) -> set[int]:
    """Ports process ``pid`` listens on (its socket inodes matched in /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_scraped_metrics_agree_with_status(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    daemon = daemon_factory(
        [{"name": "identity", "path": str(identity_model)}],
        metrics={"listen": "127.0.0.1:0"},
    )
    listen = _status(daemon)["metrics"]["listen"]
    assert listen.startswith("127.0.0.1:") and not listen.endswith(":0")
    assert _listening_tcp_ports(daemon.process.pid) == {int(listen.rsplit(":", 1)[1])}

    ok, invalid = 7, 2
    with InferenceClient(daemon.infer, timeout=30) as client:
        for _ in range(ok):
            client.infer("identity", {"input": np.zeros(IDENTITY, np.float32)})
        for _ in range(invalid):
            with pytest.raises(RemoteError):
                client.infer("identity", {"input": np.zeros((1, 3, 224, 225), np.float32)})

    started = time.perf_counter()
    text, content_type = _scrape(listen)
    scrape_s = time.perf_counter() - started
    assert content_type.startswith("text/plain; version=0.0.4")
    status = _status(daemon)
    model = next(m for m in status["models"] if m["model"] == "identity")
    samples = _samples(text)

    assert model["requests"] == ok + invalid
    assert _value(samples, "inferd_requests_total", model="identity") == model["requests"]
    assert model["responses"] == {"OK": ok, "INVALID_ARGUMENT": invalid}
    for code in ("OK", "INVALID_ARGUMENT", "INTERNAL", "DEADLINE_EXCEEDED"):
        expected = model["responses"].get(code, 0)  # a code never returned is 0, not absent
        assert _value(samples, "inferd_responses_total", model="identity", code=code) == expected
    count = _value(samples, "inferd_request_duration_seconds_count", model="identity")
    assert (
        count
        == ok
        == _value(samples, "inferd_request_duration_seconds_bucket", model="identity", le="+Inf")
    )
    assert 0 < _value(samples, "inferd_request_duration_seconds_sum", model="identity") < 60
    assert _value(samples, "inferd_queue_depth", model="identity") == model["queue_depth"] == 0
    assert _value(samples, "inferd_queue_capacity", model="identity") == model["queue_capacity"]
    assert _value(samples, "inferd_model_fallback", model="identity") == 0
    runtime = {"model": "identity", "configured_runtime": "onnx_trt_ep"}
    assert _value(samples, "inferd_model_runtime", runtime="onnx_trt_ep", **runtime) == 1
    assert _value(samples, "inferd_model_runtime", runtime="tensorrt", **runtime) == 0
    assert _value(samples, "inferd_model_state", model="identity", state="serving") == 1
    assert _value(samples, "inferd_daemon_state", state=status["daemon"]["state"]) == 1
    fdr = status["fdr"]
    assert _value(samples, "inferd_fdr_records_dropped_total") == fdr["records_dropped"] == 0
    assert _value(samples, "inferd_fdr_records_written_total") <= fdr["records_written"]
    assert _value(samples, "inferd_fdr_queue_bytes") >= 0 and "queue_bytes" in fdr
    security = status["security"]
    assert _value(samples, "inferd_runtime_switch_rate_limited_total") == 0
    assert security["switch_limit"]["refused"] == 0
    guard = security["descriptor_guard"]
    assert _value(samples, "inferd_descriptor_guard_episodes_total") == guard["episodes"] == 0
    assert _value(samples, "inferd_descriptor_guard_connections_ended_total") == 0
    version = {"version": status["daemon"]["version"]}
    assert (
        _value(
            samples, "inferd_daemon_info", config=status["daemon"]["config_fingerprint"], **version
        )
        == 1
    )
    # No thermal source on this machine: readings are absent, never 0.
    assert status["thermal"]["available"] is False
    assert _value(samples, "inferd_thermal_telemetry_available") == 0
    assert not any(name.startswith(("inferd_gpu_", "inferd_cpu_")) for name, _ in samples)
    assert status["metrics"]["requests"]["scrape"] == 1
    assert status["metrics"]["last_collect_s"] > 0
    started = time.perf_counter()
    _scrape(listen)
    again_s = time.perf_counter() - started
    print(
        f"scrape of {len(text)} bytes, {len(samples)} samples: first {scrape_s * 1000:.1f} ms "
        f"(imports prometheus_client), then {again_s * 1000:.1f} ms "
        f"(collecting {_status(daemon)['metrics']['last_collect_s'] * 1000:.2f} ms)"
    )

    # What Prometheus asks for: OpenMetrics, which its own parser accepts.
    text, content_type = _scrape(listen, OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert text.endswith("# EOF\n")
    families = {family.name: family for family in openmetrics_families(text)}
    assert families["inferd_request_duration_seconds"].type == "histogram"
    assert families["inferd_request_duration_seconds"].unit == "seconds"
    assert families["inferd_responses"].type == "counter"


def test_endpoint_is_bounded(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(metrics={"listen": "127.0.0.1:0"})
    host, port = _status(daemon)["metrics"]["listen"].rsplit(":", 1)
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(f"http://{host}:{port}/", timeout=10)
    assert raised.value.code == 404
    post = urllib.request.Request(f"http://{host}:{port}/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(post, timeout=10)
    assert raised.value.code == 501
    with socket.create_connection((host, int(port)), timeout=10) as huge:
        huge.sendall(b"GET /metrics HTTP/1.0\r\nX-Filler: " + b"a" * 10_000 + b"\r\n\r\n")
        assert huge.recv(100).startswith(b"HTTP/1.0 431 ")
    # A client that sends nothing holds the one thread only until the read deadline:
    # the daemon closes it, and a scrape queued behind it is served.
    with socket.create_connection((host, int(port)), timeout=10) as silent:
        silent.sendall(b"GET /metr")
        text, _ = _scrape(f"{host}:{port}")
        assert "inferd_uptime_seconds" in text
        assert silent.recv(100) == b""  # closed by the daemon, without a reply
    requests = _status(daemon)["metrics"]["requests"]
    assert requests == {"not_found": 1, "bad_method": 1, "too_large": 1, "timeout": 1, "scrape": 1}


def test_textfile_is_written_atomically_and_removed_at_stop(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(metrics={"textfile_dir": "metrics", "textfile_interval_s": 1})
    textfile = daemon.workdir / "state" / "metrics" / "inferd.prom"
    wait_until(lambda: _status(daemon)["metrics"]["textfile_writes"] >= 2, message="two writes")
    described = _status(daemon)["metrics"]
    assert described["textfile"] == str(textfile) and described["listen"] is None
    assert textfile.stat().st_mode & 0o777 == 0o640
    assert textfile.parent.stat().st_mode & 0o777 == 0o750
    samples = _samples(textfile.read_text())
    assert _value(samples, "inferd_requests_total", model="demo") == 0
    assert [p.name for p in textfile.parent.iterdir()] == ["inferd.prom"]  # no temp left
    assert _listening_tcp_ports(daemon.process.pid) == set()
    assert daemon.stop() == 0
    assert not textfile.exists()


def test_metrics_are_off_by_default(daemon: DaemonProcess) -> None:
    described = _status(daemon)["metrics"]
    assert described["enabled"] is False and described["running"] is False
    assert described["listen"] is None and described["textfile"] is None
    assert _listening_tcp_ports(daemon.process.pid) == set()
    assert "metrics_started" not in daemon.log()


def test_a_port_in_use_is_reported_and_the_daemon_serves_on(
    daemon_factory: DaemonFactory,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = daemon_factory(metrics={"listen": f"127.0.0.1:{port}"})
        described = _status(daemon)["metrics"]
    assert described["running"] is False and described["listen"] is None
    assert "cannot start the metrics exporter" in described["last_error"]
    assert "metrics_unavailable" in daemon.log()
    with InferenceClient(daemon.infer, timeout=30) as client:
        client.infer("demo", {"image": np.zeros(IDENTITY, np.float32)})
