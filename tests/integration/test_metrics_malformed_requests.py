"""The metrics endpoint of a real daemon and requests that are not a plain
``GET /metrics``: each one is counted in ``status.metrics.requests`` (a malformed
request line, an HTTP version it does not speak, too many headers), and an
``Accept`` header ``prometheus_client`` cannot parse gets the text format, not a 500."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferd_client import OperatorClient
from tests.conftest import DaemonFactory, DaemonProcess

pytestmark = pytest.mark.integration


def _metrics_status(daemon: DaemonProcess) -> dict[str, Any]:
    with OperatorClient(daemon.control, timeout=10) as operator:
        return operator.status()["metrics"]


def _exchange(host: str, port: int, request: bytes) -> bytes:
    """``request`` sent on a connection of its own; all the daemon answered."""
    with socket.create_connection((host, port), timeout=10) as connection:
        connection.sendall(request)
        connection.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def test_every_malformed_request_is_counted_and_a_bad_accept_gets_text(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(metrics={"listen": "127.0.0.1:0"})
    host, port_text = _metrics_status(daemon)["listen"].rsplit(":", 1)
    port = int(port_text)
    many_headers = b"".join(b"X-%d: a\r\n" % index for index in range(120))  # < 8 KiB
    assert b"431" in _exchange(host, port, b"GET /metrics HTTP/1.0\r\n" + many_headers + b"\r\n")
    assert b"Bad request" in _exchange(host, port, b"NOT A REQUEST LINE AT ALL\r\n\r\n")
    assert b"505" in _exchange(host, port, b"GET /metrics HTTP/2.0\r\n\r\n")

    request = urllib.request.Request(f"http://{host}:{port}/metrics")
    request.add_header("Accept", "text/plain; version=abc")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    assert "inferd_uptime_seconds" in {
        family.name for family in text_string_to_metric_families(text)
    }

    requests = _metrics_status(daemon)["requests"]
    assert requests == {"too_large": 1, "bad_request": 2, "scrape": 1}
