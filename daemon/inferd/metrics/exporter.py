"""The metrics exporter: thread ``inferd-metrics`` serving ``GET /metrics`` on
``metrics.listen`` and writing ``<metrics.textfile_dir>/inferd.prom`` every
``metrics.textfile_interval_s`` (atomically: ``inferd.durable``; in a directory
the daemon owns: ``inferd.owned_files``).

It is a ``prometheus_client`` collector: each scrape or write reads the daemon's
``status`` and the models' latency histograms at that moment
(``inferd.metrics.families``).  Off unless configured.  A failure to start it
(``prometheus-client`` not installed, the port taken, an unsafe directory) is
logged (``metrics_unavailable``) and shown in ``status.metrics``; the daemon
serves on: losing a monitoring view must not ground perception.  At a clean
stop the textfile is removed, so its absence means the daemon is not running
(after a crash ``node_textfile_mtime_seconds`` tells its age).

A scrape is served from the collection of the last ``SCRAPE_CACHE_S`` if there
is one (each format encoded once from it): reading ``status`` and encoding it
holds the GIL for 2-8 ms, and a local client scraping in a loop (any local user
may) made inference's p99 5-7 times worse.  The textfile is always collected
afresh.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from inferd.config import MetricsConfig
from inferd.durable import atomic_write_bytes
from inferd.errors import UnsafeDirectoryError
from inferd.metrics import families
from inferd.metrics.http import Clock, MetricsServer
from inferd.owned_files import FILE_MODE, ensure_owned_dir
from inferd.serving.stats import LatencyHistogram

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

THREAD_NAME = "inferd-metrics"
#: The one OpenMetrics version the encoder writes (``prometheus_client`` 0.2x).
_OPENMETRICS = "application/openmetrics-text"
_OPENMETRICS_1 = f"{_OPENMETRICS}; version=1.0.0;"
#: How long the thread waits at most between two looks at its stop flag.
_TICK_S = 0.5
#: How long a scrape's collection is served again: scrapers ask every 5-15 s, so a
#: second scrape this soon is another scraper or a flood, and gets the same values.
SCRAPE_CACHE_S = 1.0
#: The formats (``Content-Type``) a collection is kept encoded in: what
#: ``choose_encoder`` names is a short fixed list (two formats, four escapings);
#: past this, one not kept is encoded per scrape.
_MAX_FORMATS = 16

log = structlog.get_logger("inferd.metrics")


class _Stats(Protocol):
    def latency_histogram(self) -> LatencyHistogram: ...


class _Slot(Protocol):
    @property
    def stats(self) -> _Stats: ...


class MetricsSource(Protocol):
    """What the exporter reads: the daemon (its ``status`` op and model slots)."""

    @property
    def slots(self) -> Mapping[str, _Slot]: ...

    def status(self, _header: dict[str, Any]) -> dict[str, Any]: ...


class _Collector:
    """prometheus_client's Collector protocol (``collect`` only: no ``describe``,
    which the registry would call at registration)."""

    def __init__(self, exporter: MetricsExporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Metric]:
        return self._exporter.collect()


class _Frozen:
    """A collector that yields one collection's metrics, again and again."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


@dataclass
class _Served:
    """The collection scrapes are served from until ``at + SCRAPE_CACHE_S``."""

    at: float
    registry: CollectorRegistry
    bodies: dict[str, bytes] = field(default_factory=dict)  # Content-Type -> body


class MetricsExporter:
    def __init__(
        self, config: MetricsConfig, source: MetricsSource, clock: Clock = time.monotonic
    ) -> None:
        self._config = config
        self._source = source
        self._clock = clock
        self._served: _Served | None = None
        self._registry: CollectorRegistry | None = None
        self._server: MetricsServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._requests: Counter[str] = Counter()
        self._textfile_writes = 0
        self._last_collect_s: float | None = None
        self._error: str | None = None  # why it could not start
        self._collect_error: str | None = None  # the last scrape's, until one succeeds
        self._left_out: dict[str, str] = {}  # section -> why the last collection left it out
        self._collection_errors: Counter[str] = Counter()  # collections that left each out
        self._textfile_error: str | None = None

    def collect(self) -> Iterator[Metric]:
        """What one scrape or textfile write exposes: the daemon now.  Each section of
        ``status`` is built on its own (``families.SECTIONS``): one that fails (a
        piece missing or malformed: a bug) is left out whole, counted in
        ``inferd_metrics_collection_errors_total`` and logged once per kind of
        failure; the other sections are served."""
        started = time.perf_counter()
        status = self._source.status({})
        histograms = {
            name: slot.stats.latency_histogram() for name, slot in self._source.slots.items()
        }
        metrics: list[Metric] = []
        left_out: dict[str, str] = {}
        for section, build in families.SECTIONS.items():
            try:
                built = list(build(status, histograms))  # never half a section
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                if error != self._left_out.get(section):  # once per kind, not per scrape
                    log.exception("metrics_section_left_out", section=section, error=error)
                left_out[section] = error
                self._collection_errors[section] += 1
                continue
            metrics.extend(built)
        for section in self._left_out.keys() - left_out.keys():
            log.info("metrics_section_restored", section=section)
        self._left_out = left_out  # replaced, never changed: ``describe`` reads it
        yield from metrics
        yield self._collection_errors_family()
        self._last_collect_s = time.perf_counter() - started

    def _collection_errors_family(self) -> Metric:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "inferd_metrics_collection_errors",
            "Scrapes and textfile writes that left this status section's families out: "
            "building them failed (metrics_section_left_out).",
            labels=["section"],
        )
        for section in families.SECTIONS:  # each from 0, so increase() sees the first
            family.add_metric([section], self._collection_errors[section])
        return family

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        if not self._config.enabled:
            return
        try:
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Collector(self))
            if self._config.textfile_dir is not None:
                ensure_owned_dir(self._config.textfile_dir, what="metrics.textfile_dir")
            address = self._config.address
            if address is not None:
                self._server = MetricsServer(address, self._render, self._count, self._clock)
        except (ImportError, OSError, UnsafeDirectoryError) as exc:
            hint = " (pip install 'inferd[ops]')" if isinstance(exc, ImportError) else ""
            self._error = f"cannot start the metrics exporter: {exc}{hint}"
            log.error("metrics_unavailable", error=self._error, listen=self._config.listen or None)
            return
        self._registry = registry
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        log.info("metrics_started", **self._where())

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.ident is not None:  # else its start failed
            thread.join(timeout)
        if self._server is not None:
            self._server.server_close()
        textfile = self._config.textfile
        if textfile is not None and self._registry is not None:
            try:
                textfile.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("metrics_textfile_not_removed", path=str(textfile), error=str(exc))

    def describe(self) -> dict[str, Any]:
        """``status.metrics``."""
        thread = self._thread
        error = self._error or self._collect_error or self._left_out_error()
        return {
            "enabled": self._config.enabled,
            **self._where(),
            "textfile_interval_s": self._config.textfile_interval_s,
            "running": thread is not None and thread.is_alive(),
            "requests": dict(self._requests),
            "textfile_writes": self._textfile_writes,
            "last_collect_s": self._last_collect_s,
            "last_error": error or self._textfile_error,
        }

    def _left_out_error(self) -> str | None:
        """The sections the last collection left out, and why."""
        left_out = self._left_out
        if not left_out:
            return None
        why = "; ".join(f"{section}: {error}" for section, error in left_out.items())
        return f"status sections left out of the metrics: {why}"

    def _where(self) -> dict[str, str | None]:
        textfile = self._config.textfile
        return {
            "listen": self._server.bound if self._server is not None else None,
            "textfile": str(textfile) if textfile is not None else None,
        }

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        interval = self._config.textfile_interval_s
        next_write = self._clock()
        while not self._stop.is_set():
            now = self._clock()
            if self._config.textfile is not None and now >= next_write:
                self._write_textfile()
                next_write = max(next_write + interval, now)
            wait = _TICK_S
            if self._config.textfile is not None:
                wait = min(wait, max(0.0, next_write - self._clock()))
            server = self._server
            paused = 0.0 if server is None else server.paused_until - self._clock()
            if server is not None and paused <= 0:
                server.timeout = wait
                server.handle_request()  # one connection, or none within ``wait``
            elif server is not None:  # just served one, or its accept failed a moment ago
                self._stop.wait(min(wait, paused))
            else:  # no endpoint
                self._stop.wait(wait)

    def _render(self, accept: str) -> tuple[bytes, str]:
        from prometheus_client.exposition import choose_encoder

        try:
            encoder, content_type = choose_encoder(accept)
        except Exception:  # a version it cannot parse: the format of no preference
            encoder, content_type = choose_encoder("")
        if content_type.startswith(_OPENMETRICS) and not content_type.startswith(_OPENMETRICS_1):
            # choose_encoder copies any version the scraper names ("2.x", a folded
            # header's next line) into Content-Type; the body is 1.0.0 whatever it says.
            encoder, content_type = choose_encoder(_OPENMETRICS_1)
        try:
            body = self._served_body(encoder, content_type)
        except Exception as exc:
            error = f"collecting the metrics failed: {type(exc).__name__}: {exc}"
            if error != self._collect_error:  # once per kind of failure, not per scrape
                log.exception("metrics_collect_failed")
            self._collect_error = error
            raise
        if self._collect_error is not None:
            log.info("metrics_collect_restored")
            self._collect_error = None
        return body, content_type

    def _served_body(
        self, encoder: Callable[[CollectorRegistry], bytes], content_type: str
    ) -> bytes:
        """The body of the collection of the last ``SCRAPE_CACHE_S`` in this format,
        collected (and encoded) now if there is none; a collection that fails is not
        kept (the next scrape tries again)."""
        from prometheus_client import CollectorRegistry

        now = self._clock()
        served = self._served
        if served is None or not 0 <= now - served.at < SCRAPE_CACHE_S:
            self._served = None
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Frozen(list(self.collect())))
            served = self._served = _Served(now, registry)
        body = served.bodies.get(content_type)
        if body is None:
            body = encoder(served.registry)
            if len(served.bodies) < _MAX_FORMATS:
                served.bodies[content_type] = body
        return body

    def _count(self, outcome: str, instead_of: str | None = None) -> None:
        if instead_of is not None and self._requests[instead_of] > 0:
            self._requests[instead_of] -= 1  # the request's outcome changed
            if not self._requests[instead_of]:
                del self._requests[instead_of]  # an outcome never seen is absent
        self._requests[outcome] += 1

    def _write_textfile(self) -> None:
        from prometheus_client.exposition import generate_latest

        textfile = self._config.textfile
        assert textfile is not None and self._registry is not None
        try:
            atomic_write_bytes(textfile, generate_latest(self._registry), mode=FILE_MODE)
        except Exception as exc:
            error = f"cannot write {textfile}: {type(exc).__name__}: {exc}"
            if error != self._textfile_error:  # once per kind of failure, not per interval
                log.error("metrics_textfile_write_failed", path=str(textfile), error=error)
            self._textfile_error = error
            return
        if self._textfile_error is not None:
            log.info("metrics_textfile_write_restored", path=str(textfile))
            self._textfile_error = None
        self._textfile_writes += 1
