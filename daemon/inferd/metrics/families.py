"""The daemon's ``status`` as Prometheus metric families (``inferd_*``).

Every value comes from the ``status`` document the control op returns and from
each model's latency histogram (``serving.stats``): there is no second set of
counters, so a scrape and ``inferctl status`` never disagree.  Names follow
Prometheus' conventions: base units in the name (seconds, bytes, celsius,
hertz, watts, ratio), ``_total`` on counters, state as one 0/1 series per
possible value.  A reading the host does not provide (no thermal source, no
NVML) is absent, never 0.  ``prometheus_client`` is imported here only, when a
scrape or a textfile write builds the families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from inferd.metrics import client_families
from inferd.serving.rebuild_state import REBUILD_STATES
from inferd.serving.stats import LatencyHistogram
from inferd_wire.protocol import Code

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.metrics_core import Metric

    Section = Callable[[Mapping[str, Any], Mapping[str, LatencyHistogram]], Iterator[Metric]]

DAEMON_STATES = ("starting", "serving", "degraded", "stopping")
MODEL_STATES = ("loading", "serving", "failed", "released")
RUNTIMES = ("tensorrt", "onnx_trt_ep")
#: Every error code: each gets a series (0 until used), so ``rate()`` sees the first one.
ERROR_CODES = tuple(code.value for code in Code)
#: Every code a reply can carry.
RESPONSE_CODES = ("OK", *ERROR_CODES)


#: Each section of ``status`` and its families, in the order served.  The exporter
#: builds them one by one: a section that fails (a bug) is left out, not the scrape.
SECTIONS: dict[str, Section] = {
    "daemon": lambda status, _: _daemon(status["daemon"]),
    "models": lambda status, histograms: _models(status["models"], histograms),
    "bus": lambda status, _: _bus(status["bus"]),
    "fdr": lambda status, _: _fdr(status["fdr"]),
    "alerts": lambda status, _: _alerts(status["alerts"]),
    "thermal": lambda status, _: _thermal(status["thermal"]),
    "security": lambda status, _: client_families.security(status["security"]),
    "shm": lambda status, _: client_families.shm(status.get("shm") or {}),
    "builds": lambda status, _: _builds(status["builds"]),
}


def collect(status: Mapping[str, Any], histograms: Mapping[str, LatencyHistogram]) -> list[Metric]:
    """Every section's families, all or nothing (the exporter isolates sections)."""
    return [metric for build in SECTIONS.values() for metric in build(status, histograms)]


def _gauge(
    name: str, doc: str, value: float | None = None, unit: str = "", labels: list[str] | None = None
) -> GaugeMetricFamily:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, doc, value=value, labels=labels, unit=unit)


def _counter(
    name: str, doc: str, value: float | None = None, unit: str = "", labels: list[str] | None = None
) -> CounterMetricFamily:
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, doc, value=value, labels=labels, unit=unit)


def _daemon(daemon: Mapping[str, Any]) -> Iterator[Metric]:
    info = _gauge(
        "inferd_daemon_info",
        "The daemon's version and config fingerprint.",
        labels=["version", "config"],
    )
    info.add_metric([daemon["version"], daemon["config_fingerprint"]], 1)
    yield info
    state = _gauge(
        "inferd_daemon_state", "1 for the daemon's state (status.daemon.state).", labels=["state"]
    )
    for name in DAEMON_STATES:
        state.add_metric([name], 1 if daemon["state"] == name else 0)
    yield state
    yield _gauge(
        "inferd_uptime_seconds", "Seconds since the daemon started.", daemon["uptime_s"], "seconds"
    )


def _models(
    models: list[Mapping[str, Any]], histograms: Mapping[str, LatencyHistogram]
) -> Iterator[Metric]:
    from prometheus_client.core import HistogramMetricFamily

    state = _gauge("inferd_model_state", "1 for the model's state.", labels=["model", "state"])
    runtime = _gauge(
        "inferd_model_runtime",
        "1 for the runtime serving the model (all 0 while none is loaded).",
        labels=["model", "runtime", "configured_runtime"],
    )
    fallback = _gauge(
        "inferd_model_fallback",
        "1 while the model serves on the fallback (onnx_trt_ep instead of tensorrt).",
        labels=["model"],
    )
    requests = _counter(
        "inferd_requests", "Infer requests addressed to the model.", labels=["model"]
    )
    responses = _counter(
        "inferd_responses",
        "Requests answered, by 'OK' or error code (whether or not the reply was delivered).",
        labels=["model", "code"],
    )
    late = _counter(
        "inferd_late_results", "OK replies that finished after their deadline.", labels=["model"]
    )
    latency = HistogramMetricFamily(
        "inferd_request_duration_seconds",
        "Receipt-to-result time of OK replies.",
        labels=["model"],
        unit="seconds",
    )
    queue = {
        key: _gauge(name, doc, unit=unit, labels=["model"])
        for key, name, doc, unit in (
            ("queue_depth", "inferd_queue_depth", "Requests waiting (not the one running).", ""),
            ("queue_capacity", "inferd_queue_capacity", "The model's queue_capacity.", ""),
            (
                "queue_bytes",
                "inferd_queue_bytes",
                "Tensor bytes the waiting requests hold.",
                "bytes",
            ),
            ("queue_max_bytes", "inferd_queue_max_bytes", "The model's queue_max_bytes.", "bytes"),
        )
    }
    for model in models:
        name = model["model"]
        for value in MODEL_STATES:
            state.add_metric([name, value], 1 if model["state"] == value else 0)
        for value in RUNTIMES:
            serving = 1 if model["runtime"] == value else 0
            runtime.add_metric([name, value, model["configured_runtime"]], serving)
        fallback.add_metric([name], 1 if model["fallback"] else 0)
        requests.add_metric([name], model["requests"])
        answered: dict[str, int] = {code: 0 for code in RESPONSE_CODES}
        answered.update(model["responses"])
        for code, count in answered.items():
            responses.add_metric([name, code], count)
        late.add_metric([name], model["late_results"])
        for key, family in queue.items():
            family.add_metric([name], model[key])
        histogram = histograms.get(name)
        if histogram is not None:
            buckets = [
                (repr(bound / 1e6), count)  # microseconds to seconds
                for bound, count in zip(histogram.bounds_us, histogram.cumulative, strict=False)
            ]
            buckets.append(("+Inf", histogram.count))
            latency.add_metric([name], buckets, histogram.sum_us / 1e6)
    yield from (state, runtime, fallback, requests, responses, late, latency, *queue.values())


def _bus(bus: Mapping[str, Any]) -> Iterator[Metric]:
    replies = bus["replies"]
    yield _counter(
        "inferd_bus_malformed_requests",
        "Requests refused before they were queued (bus and admission checks).",
        bus["malformed"],
    )
    yield _counter(
        "inferd_bus_oversized_messages",
        "Requests over bus.max_message_bytes or max_frames.",
        bus["oversized_messages"],
    )
    yield _counter(
        "inferd_bus_replies_dropped",
        "Replies dropped: their peer did not read (bus.max_reply_bytes_*).",
        replies["dropped"],
    )
    graces = replies["graces"]
    yield _counter(
        "inferd_bus_reply_graces",
        "Refused replies whose sender waited a release grace (bus.replies.graces.waited).",
        graces["waited"],
    )
    yield _counter(
        "inferd_bus_reply_graces_ran_out",
        "Release graces that ran out: the reply was dropped after the wait.",
        graces["ran_out"],
    )
    held_off = _counter(
        "inferd_bus_reply_graces_held_off",
        "Refused replies that waited no grace because a holdoff held, by the budget refused.",
        labels=["reason"],
    )
    for reason, skipped in sorted(graces["held_off"].items()):
        held_off.add_metric([reason], skipped)
    yield held_off
    yield _counter(
        "inferd_bus_reply_grace_wait",
        "Time senders (the engine worker, the bus thread) waited in release graces, "
        "under the bus's wire lock.",
        graces["waited_s"],
        "seconds",
    )
    yield _counter(
        "inferd_bus_busy_poll",
        "Time the engine worker spent polling for the next request without sleeping "
        "(bus.busy_poll_us): what busy polling costs a core.",
        bus["busy_poll"]["spent_us"] / 1e6,
        "seconds",
    )
    yield _gauge(
        "inferd_bus_reply_in_flight_bytes",
        "Reply bytes handed to ZeroMQ and not yet written.",
        replies["in_flight_bytes"],
        "bytes",
    )
    yield _counter("inferd_events_published", "Events published.", bus["events_published"])
    yield _counter(
        "inferd_events_dropped", "Events lost to a full publisher queue.", bus["events_dropped"]
    )
    yield _counter(
        "inferd_events_subscriptions_refused",
        "Subscriber messages refused: subscriptions no topic can match, or no subscription.",
        bus.get("events_subscriptions_refused", 0),
    )


def _builds(builds: Mapping[str, Any]) -> Iterator[Metric]:
    refused = _counter(
        "inferd_build_start_refused",
        "build.start requests the op refused, by error code (not the daemon's own rebuilds).",
        labels=["code"],
    )
    for code in ERROR_CODES:
        refused.add_metric([code], builds["start_refused"].get(code, 0))
    yield refused
    yield _counter(
        "inferd_build_start_rate_limited",
        "build.start refused RESOURCE_EXHAUSTED by builds.start_burst/start_refill_s.",
        builds["start_limit"]["refused"],
    )
    running = builds["running_limit"]
    yield _gauge("inferd_builds_running", "Builds running now.", running["running"])
    yield _gauge(
        "inferd_builds_max_running", "builds.max_running: builds at once.", running["max_running"]
    )
    yield _counter(
        "inferd_build_running_limit_refused",
        "build.start refused RESOURCE_EXHAUSTED by builds.max_running, the daemon's own "
        "rebuilds included (each then waits for a build to end).",
        running["refused"],
    )
    yield from _rebuilds(builds["rebuilds"])


def _rebuilds(rebuilds: Mapping[str, Any]) -> Iterator[Metric]:
    state = _gauge(
        "inferd_rebuild_state",
        "1 for what the background rebuilder does about a model that fell back "
        "(status.builds.rebuilds; only models that fell back since start).",
        labels=["model", "state"],
    )
    attempts = _gauge(
        "inferd_rebuild_attempts",
        "Background builds of the model started over this run (runtime.rebuild_max_attempts).",
        labels=["model"],
    )
    for model, rebuild in sorted(rebuilds["models"].items()):
        for value in REBUILD_STATES:
            state.add_metric([model, value], 1 if rebuild["state"] == value else 0)
        attempts.add_metric([model], rebuild["attempts"])
    yield state
    yield attempts


def _fdr(fdr: Mapping[str, Any]) -> Iterator[Metric]:
    yield _gauge(
        "inferd_fdr_enabled", "1 while the flight data recorder runs.", int(fdr["enabled"])
    )
    if not fdr["enabled"]:
        return
    yield _counter("inferd_fdr_records_written", "FDR records written.", fdr["records_written"])
    yield _counter(
        "inferd_fdr_records_dropped",
        "FDR records lost (queue full or a failed write).",
        fdr["records_dropped"],
    )
    yield _counter(
        "inferd_fdr_written_bytes", "Bytes written to FDR segments.", fdr["bytes_written"], "bytes"
    )
    yield _gauge("inferd_fdr_queue_depth", "FDR records waiting to be written.", fdr["queue_depth"])
    yield _gauge(
        "inferd_fdr_queue_bytes",
        "Frame bytes of the FDR records queued or being written (fdr.queue_max_bytes bounds them).",
        fdr["queue_bytes"],
        "bytes",
    )
    yield _counter(
        "inferd_fdr_segments_deleted",
        "FDR segments deleted to stay under fdr.max_total_bytes.",
        fdr["segments_deleted"],
    )
    for key, name, doc, unit in (  # the recorder's inventory: nothing is listed per scrape
        ("segments_kept", "inferd_fdr_segments_kept", "FDR segments kept, the open one too.", ""),
        ("bytes_kept", "inferd_fdr_kept_bytes", "Bytes of the FDR segments kept.", "bytes"),
        ("max_total_bytes", "inferd_fdr_max_total_bytes", "fdr.max_total_bytes.", "bytes"),
    ):
        yield _gauge(name, doc, fdr[key], unit)


def _alerts(alerts: Mapping[str, Any]) -> Iterator[Metric]:
    yield _counter("inferd_alerts_raised", "Alerts raised.", alerts["raised"])
    yield _counter("inferd_alerts_sent", "Alerts delivered to the hooks.", alerts["sent"])
    # Not a counter: a held-back repeat the rate limit sends later leaves it for ``sent``.
    yield _gauge(
        "inferd_alerts_suppressed",
        "Alerts raised and not delivered on their own: held back by the rate limit now, "
        "or counted in a delivered repeat's suppressed field.",
        alerts["suppressed"],
    )
    yield from _alert_links(alerts["hooks"], alerts.get("refused_hooks") or {})


#: Each held-alert count of a hook's link (``LinkBacklog.status``) as a counter.
LINK_COUNTERS = (
    ("held", "Alerts held because the link had nowhere to send them."),
    ("replayed", "Held alerts sent once the link had a destination, late."),
    ("expired", "Held alerts dropped unsent at 60 s old."),
    ("overflowed", "Held alerts dropped unsent for a newer one (16 are held)."),
    ("dropped_at_close", "Held alerts dropped unsent at shutdown."),
)


#: The hooks that have a ground link (``hooks.<hook>.link``).
LINK_HOOKS = frozenset(("mavlink",))


def _alert_links(hooks: Mapping[str, Any], refused: Mapping[str, str]) -> Iterator[Metric]:
    """The ground link of each hook that has one (``mavlink``: ``hooks.*.link``);
    nothing when none has.  A link hook refused at start (``refused_hooks``:
    pymavlink missing, an endpoint that cannot be opened) has ``up`` 0 alone, so
    a rule on ``inferd_alerts_link_up == 0`` fires for a ground link not there."""
    links = {name: hook["link"] for name, hook in sorted(hooks.items()) if "link" in hook}
    missing = sorted(name for name in refused if name in LINK_HOOKS and name not in links)
    if not links and not missing:
        return
    up = _gauge(
        "inferd_alerts_link_up",
        "1 while the hook's link has a destination (state up).",
        labels=["hook"],
    )
    destinations = _gauge(
        "inferd_alerts_link_destinations",
        "The ground stations the link sends to (udpin: those heard, at most 8).",
        labels=["hook"],
    )
    ignored = _counter(
        "inferd_alerts_link_ignored",
        "udpin: datagrams that taught no ground station (no HEARTBEAT with a valid checksum).",
        labels=["hook"],
    )
    waiting = _gauge(
        "inferd_alerts_link_waiting", "Alerts held now for the link (16 at most).", labels=["hook"]
    )
    counters = {
        key: _counter(f"inferd_alerts_link_{key}", doc, labels=["hook"])
        for key, doc in LINK_COUNTERS
    }
    for name in missing:
        up.add_metric([name], 0)
    for name, link in links.items():
        up.add_metric([name], 1 if link["state"] == "up" else 0)
        destinations.add_metric([name], link["destinations"])
        ignored.add_metric([name], link["ignored"])
        waiting.add_metric([name], link["waiting"])
        for key, family in counters.items():
            family.add_metric([name], link[key])
    yield from (up, destinations, ignored, waiting, *counters.values())


def _thermal(thermal: Mapping[str, Any]) -> Iterator[Metric]:
    available = bool(thermal["available"])
    yield _gauge(
        "inferd_thermal_telemetry_available",
        "1 while a thermal source answers (jtop, NVML or sysfs).",
        int(available),
    )
    yield _gauge(
        "inferd_thermal_throttle_active",
        "1 while the GPU/CPU is thermally throttled.",
        int(bool(thermal["throttle_active"])),
    )
    reading = thermal["last_reading"]
    if not available or reading is None:
        return  # a stale reading is not telemetry: absent, never 0
    source = [str(thermal["source"])]
    for key, name, doc, unit, scale in (
        ("cpu_temp_c", "inferd_cpu_temperature_celsius", "CPU temperature.", "celsius", 1.0),
        ("gpu_temp_c", "inferd_gpu_temperature_celsius", "GPU temperature.", "celsius", 1.0),
        ("clock_mhz", "inferd_gpu_clock_hertz", "GPU (SM) clock.", "hertz", 1e6),
        ("gpu_utilization_pct", "inferd_gpu_utilization_ratio", "GPU load (0..1).", "ratio", 0.01),
        ("gpu_memory_used_bytes", "inferd_gpu_memory_used_bytes", "GPU memory in use.", "bytes", 1),
        ("gpu_memory_total_bytes", "inferd_gpu_memory_total_bytes", "GPU memory.", "bytes", 1),
        (
            "gpu_power_w",
            "inferd_gpu_power_watts",
            "NVML: the GPU's draw; jtop: the module's total input power.",
            "watts",
            1.0,
        ),
    ):
        value = reading.get(key)
        if value is None:
            continue
        family = _gauge(name, doc, unit=unit, labels=["source"])
        family.add_metric(source, value * scale)
        yield family
    threshold = thermal["threshold_c"]
    if threshold is not None:
        yield _gauge(
            "inferd_thermal_throttle_threshold_celsius",
            "Temperature at which throttling is declared.",
            threshold,
            "celsius",
        )
