"""The metric families of the daemon's clients: the connections each socket holds
and what the bounds on peers refused (``status.security``), and shared memory on
``shm.sock`` (``status.shm``).  Sections of ``families.SECTIONS``, named and
built as the others are (see ``families``); moved here to keep that module under
the line cap.  The families are built from ``prometheus_client``'s classes,
imported when a collection runs, as ``families`` does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from inferd.shm.server import MAX_REFUSED_UIDS, OTHER_UIDS
from inferd_wire.protocol import Code

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


def shm(shm: Mapping[str, Any]) -> Iterator[Metric]:
    """Shared-memory regions and the requests on ``shm.sock`` (absent when off)."""
    from prometheus_client.core import CounterMetricFamily as Counter
    from prometheus_client.core import GaugeMetricFamily as Gauge

    if not shm.get("enabled"):
        return
    yield Gauge("inferd_shm_connections", "Connections to shm.sock open now.", shm["connections"])
    by_uid = Gauge(
        "inferd_shm_connections_by_uid",
        "Connections to shm.sock open now, by peer uid (only uids holding one).",
        labels=["uid"],
    )
    for uid, held in sorted(shm["connections_by_uid"].items()):
        by_uid.add_metric([str(uid)], held)
    yield by_uid
    yield Gauge(
        "inferd_shm_max_connections_per_uid",
        "shm.max_connections_per_uid.",
        shm["max_connections_per_uid"],
    )
    refused_by_uid = Counter(
        "inferd_shm_connections_refused_per_uid",
        "shm.sock connections refused at accept, by uid (only uids refused; past the first "
        f"{MAX_REFUSED_UIDS} of a code, uid '{OTHER_UIDS}') and code: RESOURCE_EXHAUSTED, "
        "their uid held shm.max_connections_per_uid; PERMISSION_DENIED, security.infer_allow.",
        labels=["uid", "code"],
    )
    for accept_code, counts in (
        (Code.RESOURCE_EXHAUSTED, shm["refused_by_uid"]),
        (Code.PERMISSION_DENIED, shm.get("denied_by_uid", {})),  # absent: none counted
    ):
        for uid, refused in sorted(counts.items()):
            refused_by_uid.add_metric([uid, accept_code.value], refused)
    yield refused_by_uid
    refused_by_code = Counter(
        "inferd_shm_refused",
        "shm.sock connections refused at accept (PERMISSION_DENIED: security.infer_allow) "
        "and messages refused before any model saw them, by error code.",
        labels=["code"],
    )
    for code in Code:  # every code: 0 until used, so rate() sees the first one
        refused_by_code.add_metric([code.value], shm["refused"].get(code.value, 0))
    yield refused_by_code
    yield Gauge(
        "inferd_shm_mapped_bytes",
        "Bytes of client regions mapped now.",
        shm["mapped_bytes"],
        unit="bytes",
    )
    yield Gauge(
        "inferd_shm_releasing_bytes",
        "Of those, bytes of released regions not yet unmapped (counted against the bounds).",
        shm["releasing_bytes"],
        unit="bytes",
    )
    yield Counter("inferd_shm_requests", "Infer requests read from shm.sock.", shm["requests"])
    yield Gauge(
        "inferd_shm_requests_in_flight", "Requests on shm.sock not yet answered.", shm["in_flight"]
    )
    yield Counter(
        "inferd_shm_unroutable_replies",
        "Replies whose shm.sock connection had closed.",
        shm["unroutable_replies"],
    )
    yield Counter(
        "inferd_shm_closed_not_reading",
        "shm.sock connections closed because their client did not read its replies.",
        shm["closed_not_reading"],
    )
    closing = shm["closing"]
    yield Gauge(
        "inferd_shm_descriptors_closing",
        "Descriptors clients passed (and connection sockets) waiting to be closed.",
        closing["waiting"],
    )
    yield Gauge(
        "inferd_shm_close_blocked_seconds",
        "How long the close in progress of a client's descriptor has taken (0: none).",
        closing["blocked_s"],
    )
    yield Counter(
        "inferd_shm_closed_for_backlog",
        "shm.sock connections closed because too many descriptors waited to be closed.",
        closing["connections_closed_for_backlog"],
    )


def security(security: Mapping[str, Any]) -> Iterator[Metric]:
    """Connections per socket and what the bounds on peers refused."""
    from prometheus_client.core import CounterMetricFamily as Counter
    from prometheus_client.core import GaugeMetricFamily as Gauge

    refused = Counter(
        "inferd_connections_refused",
        "Handshakes the daemon refused (allow-lists, unknown CURVE keys, over "
        "bus.max_connections), by socket.",
        labels=["socket"],
    )
    held = Gauge(
        "inferd_connections",
        "Connections each socket holds (bus.max_connections bounds them), by socket.",
        labels=["socket"],
    )
    for name, socket in security["sockets"].items():
        refused.add_metric([name], socket["connections_refused"])
        held.add_metric([name], socket["connections"])
    yield refused
    yield held
    yield Gauge("inferd_max_connections", "bus.max_connections.", security["max_connections"])
    yield Counter(
        "inferd_permission_denied",
        "Operator ops refused PERMISSION_DENIED.",
        security["permission_denied"],
    )
    yield Counter(
        "inferd_runtime_switch_rate_limited",
        "runtime.switch refused RESOURCE_EXHAUSTED by runtime.switch_burst/switch_refill_s.",
        security["switch_limit"]["refused"],
    )
    guard = security["descriptor_guard"]
    if guard is None:
        return  # before the daemon started: no guard yet, so no series (never 0)
    yield Counter(
        "inferd_descriptor_guard_episodes",
        "Descriptor floods the guard ended connections of (DESIGN.md 202).",
        guard["episodes"],
    )
    yield Counter(
        "inferd_descriptor_guard_connections_ended",
        "Connections past bus.max_connections the descriptor guard shut down.",
        guard["connections_ended"],
    )
    yield Counter(
        "inferd_descriptor_guard_share_passes",
        "Guard passes past its share level, many peers flooding (DESIGN.md 209).",
        guard["share_passes"],
    )
    yield Counter(
        "inferd_descriptor_guard_connections_ended_past_share",
        "Connections the descriptor guard shut down past a peer's fair share.",
        guard["connections_ended_past_share"],
    )
