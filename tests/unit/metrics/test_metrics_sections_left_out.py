"""A section of ``status`` the exporter cannot turn into metrics (a piece missing or
malformed: a bug) is left out of the scrape and of the textfile, whole, counted in
``inferd_metrics_collection_errors_total{section}`` and logged once per kind of
failure, while every other section is served; and no reply's ``Server`` header
names the interpreter.

Before (DESIGN.md 260's "Left"): one such section made every scrape 500 and every
textfile write fail while it lasted, and every reply said
``Server: BaseHTTP/0.6 Python/3.11.7``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from inferd.config import MetricsConfig
from inferd.metrics import MetricsExporter, families
from tests.unit.metrics.test_families import SHM, status
from tests.unit.metrics.test_review_metrics_http import _exchange

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

#: The ``section`` label's values: every section of ``status`` the metrics read.
SECTIONS = ("daemon", "models", "bus", "fdr", "alerts", "thermal", "security", "shm", "builds")
ERRORS = "inferd_metrics_collection_errors"


class _Source:
    """A daemon whose ``status`` is ``document``."""

    slots: Mapping[str, Any] = {}

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    def status(self, _header: dict[str, Any]) -> dict[str, Any]:
        return self.document


def _collected(exporter: MetricsExporter) -> dict[str, Metric]:
    return {family.name: family for family in exporter.collect()}


def _errors(family: Metric) -> dict[str, float]:
    return {sample.labels["section"]: sample.value for sample in family.samples}


@pytest.mark.parametrize("section", SECTIONS)
def test_a_broken_section_is_left_out_counted_and_logged_once_and_the_rest_served(
    section: str,
) -> None:
    intact = status(shm=SHM)
    every = {family.name for family in families.collect(intact, {})}
    source = _Source({**intact, section: "not a mapping"})
    exporter = MetricsExporter(MetricsConfig(), source)
    with capture_logs() as logs:
        first, second = _collected(exporter), _collected(exporter)
        described = exporter.describe()
        source.document = intact
        restored = _collected(exporter)
    own = {family.name for family in families.SECTIONS[section](intact, {})}
    assert own and own < every
    assert first.keys() == second.keys() == (every - own) | {ERRORS}
    assert restored.keys() == every | {ERRORS}
    assert _errors(first[ERRORS]) == {name: int(name == section) for name in SECTIONS}
    assert _errors(second[ERRORS])[section] == _errors(restored[ERRORS])[section] == 2
    assert described["last_error"].startswith(
        f"status sections left out of the metrics: {section}: "
    )
    assert exporter.describe()["last_error"] is None
    events = Counter(line["event"] for line in logs)
    assert events == {"metrics_section_left_out": 1, "metrics_section_restored": 1}, events
    assert all(line["section"] == section for line in logs)


def test_the_endpoint_and_the_textfile_serve_the_other_sections_and_name_no_interpreter(
    tmp_path: Path,
) -> None:
    fdr = {key: value for key, value in status()["fdr"].items() if key != "bytes_kept"}
    config = MetricsConfig(listen="127.0.0.1:0", textfile_dir=tmp_path, textfile_interval_s=3600.0)
    exporter = MetricsExporter(config, _Source(status(fdr=fdr)))
    exporter.start()
    try:
        port = int(exporter.describe()["listen"].rsplit(":", 1)[1])
        answers = [
            _exchange(port, request)
            for request in (
                b"GET /metrics HTTP/1.0\r\n\r\n",
                b"GET /elsewhere HTTP/1.0\r\n\r\n",  # 404
                b"POST /metrics HTTP/1.0\r\n\r\n",  # 501, answered by the stdlib's send_error
            )
        ]
        # The thread writes the textfile before it serves its first connection.
        textfile = (tmp_path / "inferd.prom").read_text()
        described = exporter.describe()
    finally:
        exporter.stop()
    for answer, code in zip(answers, (b"200", b"404", b"501"), strict=True):
        head = answer.partition(b"\r\n\r\n")[0]
        assert head.startswith(b"HTTP/1.0 " + code + b" "), head
        assert b"\r\nServer: inferd\r\n" in head and b"Python" not in head, head
    scraped = answers[0].partition(b"\r\n\r\n")[2].decode()
    for text, left_out in ((textfile, 1), (scraped, 2)):  # the textfile was collected first
        samples = {
            (sample.name, sample.labels.get("section")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        assert samples[("inferd_uptime_seconds", None)] == 12.5
        assert samples[("inferd_alerts_raised_total", None)] == 5
        assert not [name for name, _ in samples if name.startswith("inferd_fdr_")]
        assert samples[(f"{ERRORS}_total", "fdr")] == left_out
        assert samples[(f"{ERRORS}_total", "models")] == 0
    assert described["textfile_writes"] == 1
    assert described["requests"] == {"scrape": 1, "not_found": 1, "bad_method": 1}
    assert "fdr: KeyError: 'bytes_kept'" in described["last_error"]
