"""How ``inferctl`` shows replies and events to a person: aligned text and tables.

Every value goes through ``text``: ``None`` is ``-``, booleans ``yes``/``no``,
nanosecond timestamps local ISO times, byte counts with a binary unit, lists
comma-separated; never a Python repr.  The known documents (``status``,
``health``, ``models``, ``thermal``, an inference's summary, events) have their
own layout; anything else is shown as indented ``key: value`` lines
(``generic``), tables for lists of maps.  ``--json`` bypasses all of this.
Text the daemon sends is shown through ``printable``: a control character in it
reaches no terminal.  ``printable`` is ``inferd_wire.printable``'s, re-exported here
(the daemon's log lines use it too, without importing the client library).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from inferd_wire.printable import printable

__all__ = ["Column", "generic", "pairs", "printable", "size", "table", "text", "timestamp"]

Column = tuple[str, Callable[[Mapping[str, Any]], Any]]

_BYTE_KEYS = ("bytes",)
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def text(value: Any, key: str = "") -> str:
    """One value as a person reads it (``key`` tells bytes and times apart)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and key.endswith("ts_ns"):
        return timestamp(value)
    if isinstance(value, int) and any(part in key for part in _BYTE_KEYS) and value >= 1024:
        return size(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, list | tuple):
        return ", ".join(text(item) for item in value) if value else "-"
    if isinstance(value, Mapping):
        return ", ".join(f"{text(k)}={text(v, str(k))}" for k, v in value.items()) if value else "-"
    return printable(str(value))


def size(nbytes: int) -> str:
    amount = float(nbytes)
    for unit in _UNITS:
        if amount < 1024 or unit == _UNITS[-1]:
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{nbytes} B"  # pragma: no cover - the loop always returns


def timestamp(ts_ns: int) -> str:
    moment = datetime.datetime.fromtimestamp(ts_ns / 1e9).astimezone()
    return moment.isoformat(timespec="milliseconds")


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> list[str]:
    """Aligned columns, a header line first; no trailing spaces."""
    cells = [[header for header, _ in columns]]
    cells += [[text(read(row)) for _, read in columns] for row in rows]
    widths = [max(len(line[index]) for line in cells) for index in range(len(columns))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    ]


def pairs(items: Sequence[tuple[str, Any]], indent: int = 0) -> list[str]:
    """``key: value`` lines with the values aligned."""
    shown = [(text(key), value) for key, value in items]  # a reply's key may be bytes
    width = max((len(key) for key, _ in shown), default=0)
    pad = "  " * indent
    return [f"{pad}{key + ':':<{width + 1}} {text(value, key)}".rstrip() for key, value in shown]


def generic(document: Mapping[str, Any], indent: int = 0) -> list[str]:
    """Any reply: scalars aligned, maps indented under their key, lists of maps as
    tables of their keys."""
    lines: list[str] = []
    scalars = [(k, v) for k, v in document.items() if not _nested(v)]
    lines += pairs(scalars, indent)
    for key, value in document.items():
        if not _nested(value):
            continue
        lines.append(f"{'  ' * indent}{text(key)}:")
        if isinstance(value, Mapping):
            lines += generic(value, indent + 1)
        else:
            keys = list(dict.fromkeys(k for item in value for k in item))
            columns = [(text(k), lambda row, k=k: row.get(k)) for k in keys]
            lines += ["  " * (indent + 1) + line for line in table(value, columns)]
    return lines


def _nested(value: Any) -> bool:
    if isinstance(value, Mapping):
        return bool(value)
    return isinstance(value, list) and bool(value) and all(isinstance(i, Mapping) for i in value)


# -- known documents ------------------------------------------------------------------------


def _runtime(model: Mapping[str, Any]) -> str:
    runtime = text(model.get("runtime"))
    if model.get("fallback"):
        configured = model.get("configured_runtime")
        runtime += f" (fallback from {configured})" if configured else " (fallback)"
    return runtime


def _latency(model: Mapping[str, Any], quantile: str) -> str:
    value = (model.get("latency_us") or {}).get(quantile)
    return "-" if value is None else f"{value / 1000:.2f} ms"


def _errors(model: Mapping[str, Any]) -> str:
    codes = {code: n for code, n in (model.get("responses") or {}).items() if code != "OK"}
    return text(codes) if codes else "-"


MODEL_COLUMNS: list[Column] = [
    ("MODEL", lambda m: m.get("model")),
    ("STATE", lambda m: m.get("state")),
    ("RUNTIME", _runtime),
    ("PROVIDERS", lambda m: m.get("active_providers")),
    ("QUEUE", lambda m: f"{m.get('queue_depth', 0)}/{m.get('queue_capacity', '-')}"),
    ("REQUESTS", lambda m: m.get("requests")),
    ("OK", lambda m: (m.get("responses") or {}).get("OK", 0)),
    ("ERRORS", _errors),
    ("P50", lambda m: _latency(m, "p50")),
    ("P99", lambda m: _latency(m, "p99")),
]


def status(result: Mapping[str, Any]) -> list[str]:
    daemon = result.get("daemon", {})
    lines = [
        f"inferd {text(daemon.get('version'))}  pid {text(daemon.get('pid'))}  "
        f"{text(daemon.get('state'))}  up {text(daemon.get('uptime_s'))} s  "
        f"config {text(daemon.get('config_source'))}",
        "",
    ]
    models = result.get("models", [])
    lines += table(models, MODEL_COLUMNS)
    notes = [
        f"  {m['model']}: {label} {m[key]}"
        for m in models
        for key, label in (
            ("reason", "reason:"),
            ("provider_degradation", "providers degraded:"),
            ("engine_cache_error", "no engine cache:"),
        )
        if m.get(key)
    ]
    if notes:
        lines += ["", *notes]
    lines += _shm_lines(result.get("shm") or {})
    thermal = result.get("thermal", {})
    fdr = result.get("fdr", {})
    bus = result.get("bus", {})
    replies = bus.get("replies") or {}
    lines += [
        "",
        *pairs(
            [
                ("thermal", _thermal_line(thermal)),
                ("fdr", _fdr_line(fdr)),
                (
                    "bus",
                    f"malformed {bus.get('malformed', 0)}, oversized "
                    f"{bus.get('oversized_messages', 0)}, replies dropped "
                    f"{replies.get('dropped', 0)}, events published "
                    f"{bus.get('events_published', 0)} (dropped {bus.get('events_dropped', 0)}), "
                    f"subscriptions refused {bus.get('events_subscriptions_refused', 0)}",
                ),
                ("reply grace", _graces_line(replies.get("graces"))),
                ("busy poll", _busy_poll_line(bus.get("busy_poll") or {})),
                ("send buffer", _send_buffer_line(bus.get("send_buffer") or {})),
                ("security", _security_line(result.get("security") or {})),
                ("builds", _builds_line(result.get("builds") or {})),
                ("rebuilds", _rebuilds_line((result.get("builds") or {}).get("rebuilds") or {})),
                ("alerts", _alerts_line(result.get("alerts") or {})),
            ]
        ),
    ]
    return lines


REGION_COLUMNS: list[Column] = [
    ("REGION", lambda r: r.get("id")),
    ("LABEL", lambda r: r.get("label")),
    ("OWNER", lambda r: "uid {uid} pid {pid}".format(**(r.get("owner") or {}))),
    ("SIZE", lambda r: size(r.get("nbytes", 0))),
    ("IN USE", lambda r: r.get("in_use")),
    ("STATE", lambda r: r.get("state")),
]


def _alerts_line(alerts: Mapping[str, Any]) -> str:
    """What was raised and sent, then each hook's link (the MAVLink ground link:
    ``no_peer`` before a ground station is heard), the alerts it holds for want
    of a destination, and why it is down."""
    line = f"raised {text(alerts.get('raised', 0))}, sent {text(alerts.get('sent', 0))}"
    for name, hook in (alerts.get("hooks") or {}).items():
        link = hook.get("link") if isinstance(hook, Mapping) else None
        if not isinstance(link, Mapping):
            continue
        line += f"; {text(name)}: {text(link.get('state'))}"
        if link.get("waiting"):
            line += f", {text(link['waiting'])} waiting"
        if link.get("error") is not None:
            line += f" ({text(link['error'])})"
    return line


def _busy_poll_line(busy_poll: Mapping[str, Any]) -> str:
    """The engine worker's busy polls (DESIGN.md 110): the setting, what they
    caught and missed, and the core time they cost."""
    if not busy_poll.get("us"):
        return "off"
    spent_us = busy_poll.get("spent_us", 0)
    spent = f"{spent_us / 1e6:.2f} s" if spent_us >= 1_000_000 else f"{spent_us / 1000:.1f} ms"
    return (
        f"{busy_poll['us']} us after each reply: caught {busy_poll.get('caught', 0)}, "
        f"missed {busy_poll.get('missed', 0)}, {spent} spent"
    )


def _graces_line(graces: Mapping[str, Any] | None) -> str:
    """The release graces refused replies waited, under the bus's wire lock
    (DESIGN.md 251, 280): how many, how many ran out, the time, and the ones a
    holdoff skipped (for a client's own backlog, for the total)."""
    if graces is None:
        return "not reported"  # a daemon from before they were counted
    waited_s = graces.get("waited_s", 0.0)
    spent = f"{waited_s:.2f} s" if waited_s >= 1 else f"{waited_s * 1000:.1f} ms"
    held_off = graces.get("held_off") or {}
    return (
        f"waited {graces.get('waited', 0)} ({graces.get('ran_out', 0)} ran out), {spent}; "
        f"held off {held_off.get('peer_budget', 0)} per client, "
        f"{held_off.get('total_budget', 0)} for the total"
    )


def _security_line(security: Mapping[str, Any]) -> str:
    """What the bounds on peers refused: runtime.switch's rate (DESIGN.md 199) and
    the descriptor guard's floods (DESIGN.md 202)."""
    switch = security.get("switch_limit") or {}
    line = (
        f"switch rate limited {switch.get('refused', 0)} (burst {text(switch.get('burst'))}, "
        f"one every {text(switch.get('refill_s'))} s)"
    )
    guard = security.get("descriptor_guard")
    if guard is None:
        return line + ", descriptor guard not started"
    return line + (
        f", descriptor guard: {guard.get('episodes', 0)} floods, "
        f"{guard.get('connections_ended', 0)} connections ended "
        f"(past {guard.get('threshold', 0)} of {guard.get('limit', 0)} descriptors)"
    )


def _builds_line(builds: Mapping[str, Any]) -> str:
    """``build.start``'s refusals by code, and its rate per peer."""
    refused = builds.get("start_refused") or {}
    limit = builds.get("start_limit") or {}
    by_code = ", ".join(f"{code} {count}" for code, count in sorted(refused.items()))
    running = builds.get("running_limit")
    return (
        f"build.start refused {sum(refused.values())}"
        + (f" ({by_code})" if by_code else "")
        + f", rate limited {limit.get('refused', 0)} (burst {text(limit.get('burst'))}, "
        f"one every {text(limit.get('refill_s'))} s)"
        + (
            f"; running {running.get('running', 0)} of {text(running.get('max_running'))} "
            f"(builds.max_running refused {running.get('refused', 0)})"
            if running
            else ""
        )
    )


def _rebuilds_line(rebuilds: Mapping[str, Any]) -> str:
    """The background rebuilder: what it does about each model that fell back."""
    if not rebuilds:  # a daemon before DESIGN.md 350
        return "-"
    if not rebuilds.get("enabled"):
        return "off (runtime.rebuild_on_fallback is false)"
    models = rebuilds.get("models") or {}
    if not models:
        return "none (no model fell back since start)"
    return "; ".join(
        f"{model}: {_rebuild(rebuild, rebuilds.get('max_attempts'))}"
        for model, rebuild in sorted(models.items())
    )


def _rebuild(rebuild: Mapping[str, Any], max_attempts: object) -> str:
    state = str(rebuild.get("state"))
    attempts = f"{rebuild.get('attempts', 0)} of {text(max_attempts)} attempts"
    if state == "building":
        return f"building {rebuild.get('build_id')} ({attempts})"
    if state == "retry_scheduled":
        return f"retry in {text(rebuild.get('retry_in_s'))} s ({attempts})"
    if state == "waiting_for_room":
        return f"waiting for builds.max_running ({rebuild.get('waiting_for_room')}; {attempts})"
    if state == "waiting_for_build":
        return f"waiting for build {rebuild.get('waiting_on_build')} of it ({attempts})"
    if state == "skipped":
        return f"no build asked for: {text(rebuild.get('skipped'))}"
    return f"{state.replace('_', ' ')} ({attempts})"


def _send_buffer_line(send_buffer: Mapping[str, Any]) -> str:
    """The kernel send buffer of the infer socket's connections (DESIGN.md 116):
    what is asked, how many connections got it, and a cap by the kernel."""
    if not send_buffer.get("bytes"):
        return "the kernel's default"
    line = f"{size(send_buffer['bytes'])} asked, {send_buffer.get('sized', 0)} connections sized"
    effective = send_buffer.get("effective_bytes")
    if send_buffer.get("capped") and effective is not None:
        line += f", {send_buffer['capped']} capped at {size(effective)} (net.core.wmem_max)"
    return line


def _shm_lines(shm: Mapping[str, Any]) -> list[str]:
    """Shared-memory regions: a summary line, then one row per region listed (the
    largest; a daemon lists a bounded number and counts the rest)."""
    if not shm.get("enabled"):
        return ["", "shm: off" + (f" ({text(shm['reason'])})" if shm.get("reason") else "")]
    regions = shm.get("regions") or []
    lines = [
        "",
        f"shm: {shm.get('regions_mapped', len(regions))} regions, "
        f"{size(shm.get('mapped_bytes', 0))} mapped of "
        f"{size(shm.get('max_bytes_total', 0))} (per uid {size(shm.get('max_bytes_per_uid', 0))}), "
        f"{shm.get('connections', 0)}/{shm.get('max_connections', 0)} connections, "
        f"huge pages: {shm.get('huge_pages', 'unknown')}",
        f"  connections per uid (at most {shm.get('max_connections_per_uid', 0)}): "
        f"{_per_uid(shm.get('connections_by_uid') or {})}; "
        f"{shm.get('refused_per_uid', 0)} refused over it"
        + (f" ({_per_uid(shm['refused_by_uid'])})" if shm.get("refused_by_uid") else ""),
        f"  requests on shm.sock: {shm.get('requests', 0)}, {shm.get('in_flight', 0)} in flight, "
        f"{shm.get('refused_in_flight', 0)} refused over "
        f"{shm.get('max_requests_per_connection', 0)} per connection, "
        f"{shm.get('closed_not_reading', 0)} connections closed for not reading",
    ]
    if shm.get("denied_by_uid"):  # security.infer_allow at accept
        lines.append(f"  connections denied (PERMISSION_DENIED): {_per_uid(shm['denied_by_uid'])}")
    if shm.get("releasing_regions"):  # counted against the bounds until unmapped
        lines.append(
            f"  released, not yet unmapped: {shm['releasing_regions']} regions, "
            f"{size(shm.get('releasing_bytes', 0))} (still used by requests, or awaiting the "
            "registration thread)"
        )
    closing = shm.get("closing") or {}
    if closing.get("waiting") or closing.get("connections_closed_for_backlog"):
        lines.append(  # a client passes descriptors whose close blocks (DESIGN.md 120)
            f"  descriptors waiting to be closed: {closing.get('waiting', 0)} (the close in "
            f"progress for {closing.get('blocked_s', 0)} s), "
            f"{closing.get('connections_closed_for_backlog', 0)} connections closed for it"
        )
    if regions:
        lines += ["  " + line for line in table(regions, REGION_COLUMNS)]
    if shm.get("regions_omitted"):
        lines.append(f"  ... and {shm['regions_omitted']} smaller regions not listed")
    return lines


def _per_uid(held: Mapping[str, int]) -> str:
    return ", ".join(f"uid {uid}: {count}" for uid, count in sorted(held.items())) or "none"


def _thermal_line(thermal: Mapping[str, Any]) -> str:
    if not thermal.get("available"):
        return "no telemetry" + (f" ({thermal['last_error']})" if thermal.get("last_error") else "")
    reading = thermal.get("last_reading") or {}
    state = "THROTTLING" if thermal.get("throttle_active") else "nominal"
    temps = ", ".join(
        f"{name} {reading[key]:.1f} C"
        for name, key in (("cpu", "cpu_temp_c"), ("gpu", "gpu_temp_c"))
        if reading.get(key) is not None
    )
    return f"{state} via {thermal.get('source')}" + (f", {temps}" if temps else "")


def _fdr_line(fdr: Mapping[str, Any]) -> str:
    if not fdr.get("enabled"):
        return "off" + (f" ({fdr['error']})" if fdr.get("error") else "")
    kept = fdr.get("segments_kept")  # None from a daemon that does not send it
    return (
        f"{fdr.get('records_written', 0)} records ({size(fdr.get('bytes_written', 0))}), "
        f"{fdr.get('records_dropped', 0)} dropped, durable to #{fdr.get('durable_seq', 0)}"
        + (
            f", {text(kept)} segment{'' if kept == 1 else 's'} "
            f"{size(fdr.get('bytes_kept', 0))} of {size(fdr.get('max_total_bytes', 0))} kept"
            if kept is not None
            else ""
        )
        + (f"; last error: {fdr['last_error']}" if fdr.get("last_error") else "")
    )


def health(result: Mapping[str, Any]) -> list[str]:
    threads = result.get("threads", {})
    down = [name for name, alive in threads.items() if not alive]
    # A reply without a threads map (or with an empty one) says nothing of them:
    # "-" (None), never "all alive" (one that is no map is not laid out: ``laid_out``).
    threads_shown: str | None = None
    if down:
        threads_shown = "NOT RUNNING: " + text(down)
    elif threads:
        threads_shown = "all alive"
    lines = pairs(
        [
            ("state", result.get("state")),
            ("uptime_s", result.get("uptime_s")),
            ("thermal", result.get("thermal")),
            ("threads", threads_shown),
        ]
    )
    models = [{"model": name, **model} for name, model in result.get("models", {}).items()]
    # health carries the queue's depth, not its capacity (that is in status).
    queued: Column = ("QUEUED", lambda m: m.get("queue_depth", 0))
    return [*lines, "", *table(models, [*MODEL_COLUMNS[:3], queued])]


def models(result: Mapping[str, Any]) -> list[str]:
    rows = [
        {"model": model["name"], "state": model.get("state"), "io": io, **tensor}
        for model in result.get("models", [])
        for io in ("inputs", "outputs")
        for tensor in model.get(io, [])
    ]
    return table(
        rows,
        [
            ("MODEL", lambda r: r["model"]),
            ("STATE", lambda r: r["state"]),
            ("IO", lambda r: r["io"][:-1]),
            ("NAME", lambda r: r.get("name")),
            ("DTYPE", lambda r: r.get("dtype")),
            ("SHAPE", lambda r: _shape(r.get("shape"))),
            ("PROFILE (min..max)", _profile),
        ],
    )


def _shape(shape: Any) -> str:
    if not isinstance(shape, list):
        return text(shape)
    return "[" + ", ".join("?" if dim is None else str(dim) for dim in shape) + "]"


def _profile(row: Mapping[str, Any]) -> str:
    profile = row.get("profile")
    if not profile:
        return "-"
    return f"{_shape(profile.get('min_shape'))}..{_shape(profile.get('max_shape'))}"


def thermal(result: Mapping[str, Any]) -> list[str]:
    return pairs(
        [
            ("state", _thermal_line(result)),
            ("threshold_c", result.get("threshold_c")),
            ("hysteresis_c", result.get("hysteresis_c")),
            ("poll_hz", result.get("poll_hz")),
            ("transitions", result.get("transitions")),
            *[(f"retry {source}", _retry(retry)) for source, retry in _retries(result)],
        ]
    )


def _retries(result: Mapping[str, Any]) -> list[tuple[Any, Mapping[str, Any]]]:
    retries = result.get("retries")  # None from a daemon that does not send it
    if not isinstance(retries, Mapping):
        return []
    return [(source, retry) for source, retry in retries.items() if isinstance(retry, Mapping)]


def _retry(retry: Mapping[str, Any]) -> str:
    """A preferred source whose opens fail: how often, why, and what comes next."""
    running, next_try = retry.get("running_s"), retry.get("next_try_in_s")
    if isinstance(running, int | float):
        then = f"an open running {running:.1f} s"
    elif isinstance(next_try, int | float):
        then = f"next try in {next_try:.1f} s"
    else:
        then = "no try due"
    return f"{retry.get('failed_opens')} failed opens, {then}: {retry.get('last_error')}"


def inference(summary: Mapping[str, Any]) -> list[str]:
    lines = pairs(
        [
            ("model", summary.get("model")),
            ("runtime", _runtime(summary)),
            ("latency_us", summary.get("latency_us")),
            ("late", summary.get("late")),
            *([("socket", _placement(shm, summary))] if (shm := summary.get("shm")) else []),
        ]
    )
    rows = [
        {"io": io, "name": name, **described}
        for io in ("inputs", "outputs")
        for name, described in summary.get(io, {}).items()
    ]
    return [
        *lines,
        "",
        *table(
            rows,
            [
                ("IO", lambda r: r["io"][:-1]),
                ("NAME", lambda r: r["name"]),
                ("DTYPE", lambda r: r.get("dtype")),
                ("SHAPE", lambda r: _shape(r.get("shape"))),
                ("MIN", lambda r: r.get("min")),
                ("MAX", lambda r: r.get("max")),
                ("MEAN", lambda r: r.get("mean")),
                ("SHA256", lambda r: (r.get("sha256") or "")[:16]),
            ],
        ),
    ]


def _placement(shm: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    """The socket an ``infer --shm`` request went on, and which tensors were in the
    region (an output of dynamic shape comes back as a frame)."""
    outputs = shm.get("outputs_in_region", [])
    frames = [name for name in summary.get("outputs", {}) if name not in outputs]
    placement = f"in shared memory: {text([*shm.get('inputs_in_region', []), *outputs])}"
    if frames:
        placement += f"; as frames: {text(frames)}"
    return f"{shm.get('socket')} ({placement})"


def event(topic: str, payload: Mapping[str, Any]) -> str:
    """One line per event: local time, topic, what happened."""
    when = timestamp(payload["ts_ns"]) if isinstance(payload.get("ts_ns"), int) else "-"
    shown = {k: v for k, v in payload.items() if k not in ("ts_ns", "seq")}
    if topic == "alert":
        detail = f"{shown.get('level')} {shown.get('code')}: {shown.get('message')}"
    elif topic == "runtime":
        detail = f"{shown.get('model')} {shown.get('state')} on {_runtime(shown)}" + (
            f" ({shown['reason']})" if shown.get("reason") else ""
        )
    elif topic == "health":
        detail = (
            f"{shown.get('state')}, thermal {shown.get('thermal')}, up {shown.get('uptime_s')} s"
        )
    else:
        detail = text(shown)
    return f"{when}  {topic:<8} {detail}"


def build(build: Mapping[str, Any]) -> list[str]:
    """One build of ``build.status``: its state, a cancel's latencies, its outcome,
    its phase counts and active path, then (``build.status ID`` only: the listing
    has none) its phase tree indented by depth and the phases it left out."""
    label = " (SIMULATED)" if build["simulated"] else ""
    lines = [
        f"build {build['build_id']} model={build['model']} builder={build['builder']}{label}",
        f"  state: {build['state']}  elapsed: {build['elapsed_s']} s"
        # A daemon before build deadlines does not say it.
        + ("" if build.get("deadline_s") is None else f"  deadline: {build['deadline_s']:g} s"),
    ]
    if build["cancel_source"]:
        # A latency not measured yet (a cancel in progress) is "-", never "None ms".
        def ms(key: str) -> str:
            return "-" if build.get(key) is None else f"{build[key]} ms"

        lines.append(
            f"  cancelled by {build['cancel_source']}"
            f"{' (escalated: child killed)' if build['escalated'] else ''};"
            f" request->ack {ms('cancel_latency_ms')},"
            f" ack->cleanup {ms('cleanup_latency_ms')},"
            f" request->exit {ms('cancel_to_exit_ms')}"
        )
    # timing_cache_start: null until the build's first event; timing_cache_mode: null
    # until the child's report; either absent from an older daemon.
    keys = (
        "cleanup_status",
        "timing_cache_start",
        "timing_cache_mode",
        "retry_policy",
        "summary_path",
        "error",
    )
    for key in (*keys, "adoption"):
        if build.get(key):
            lines.append(f"  {key}: {text(build[key], key)}")
    stall = build.get("last_stall")  # build.status ID only, from a daemon with stalls
    if isinstance(stall, Mapping):
        silent = stall.get("silent_s")
        where = " > ".join(text(name) for name in stall.get("path") or []) or "(before a phase)"
        lines.append(
            f"  last stall: {'?' if silent is None else text(silent)} s without progress"
            f" at {where}"
            + ("" if stall.get("in_a_row") is None else f" ({text(stall['in_a_row'])} in a row)")
        )

    def walk(node: Mapping[str, Any], depth: int) -> None:
        done = f"{node['completedSteps']}/{node['numSteps']}"
        lines.append(f"  {'  ' * depth}- {node['name']} [{node['status']} {done}]")
        for child in node["children"]:
            walk(child, depth + 1)

    tree = build["phase_tree"]
    if "phases" in tree:  # a daemon before the listing's brief trees: roots only
        active = " > ".join(str(name) for name in tree.get("activePath") or [])
        lines.append(
            f"  phases: {tree['phases']}  stalls: {tree.get('stalls', 0)}"
            + (f"  active: {active}" if active else "")
        )
    for root in tree.get("roots", []):
        walk(root, 0)
    if tree.get("omittedPhases"):
        lines.append(
            f"  ... {tree['omittedPhases']} more phases not shown (running and newest first)"
        )
    return lines


def build_event(event: Mapping[str, Any], depth: dict[str, int]) -> str:
    """One ``build`` event, indented by its phase's depth (``depth``: each phase's,
    kept by the caller across events)."""
    kind, phase = event.get("type"), event.get("phaseId")
    if kind == "phase_start" and phase is not None:
        depth[phase] = depth.get(event.get("parentId") or "", -1) + 1
    pad = "  " * depth.get(phase or "", 0)
    label = " [simulated]" if event.get("simulated") else ""
    detail = dict(event.get("detail") or {})
    # Named in words: on a build's first event the timing-cache decision it starts
    # with, on its terminal event the outcome's (a daemon or child before them sends
    # none); the rest of the event's facts as they came.
    cache = ""
    if "timingCacheMode" in detail:
        when = "" if kind in ("cancelled", "completed", "failed") else " at start"
        cache = f" timing cache{when}: {text(detail.pop('timingCacheMode'))}"
    if kind == "phase_start":
        return f"{pad}+ {event.get('name')} ({event.get('numSteps')} steps){cache}"
    if kind == "step":
        return f"{pad}  . {event.get('name')} step {(event.get('step') or 0) + 1}"
    if kind == "phase_finish":
        return f"{pad}- {event.get('name')} done"
    return f"{str(kind).upper()} build {event.get('buildId')}{label}{cache} {json.dumps(detail)}"
