"""inferctl's human output (``inferd_client.cli_format``): values as a person reads
them, never a Python repr, and tables without trailing spaces."""

from __future__ import annotations

import re

from inferd_client import cli_format


def test_values_read_as_text_not_reprs() -> None:
    assert cli_format.text(None) == "-"
    assert cli_format.text(True) == "yes" and cli_format.text(False) == "no"
    assert cli_format.text(["a", "b"]) == "a, b" and cli_format.text([]) == "-"
    assert cli_format.text({"OK": 3, "INTERNAL": 1}) == "OK=3, INTERNAL=1"
    assert cli_format.text(268435456, "queue_max_bytes") == "256.0 MiB"
    assert cli_format.text(12, "bytes_written") == "12"
    stamp = cli_format.text(1_796_172_769_196_490_490, "ts_ns")
    assert stamp.startswith("2026-12-") and "1796172769" not in stamp
    assert cli_format.text(0.123456) == "0.123"


def test_tables_align_and_have_no_trailing_spaces() -> None:
    lines = cli_format.table(
        [{"a": "x", "b": None}, {"a": "longer", "b": 2}],
        [("A", lambda r: r["a"]), ("B", lambda r: r["b"])],
    )
    assert lines == ["A       B", "x       -", "longer  2"]


def test_status_is_a_table_with_fallback_and_reasons() -> None:
    model = {
        "model": "det",
        "state": "serving",
        "configured_runtime": "tensorrt",
        "runtime": "onnx_trt_ep",
        "fallback": True,
        "active_providers": ["CPUExecutionProvider"],
        "reason": "no engine for this host",
        "queue_depth": 1,
        "queue_capacity": 64,
        "requests": 10,
        "responses": {"OK": 9, "DEADLINE_EXCEEDED": 1},
        "latency_us": {"window": 10, "p50": 1500, "p99": 4200},
    }
    result = {
        "daemon": {"version": "0.1.0", "pid": 7, "state": "degraded", "uptime_s": 3.5},
        "models": [model],
        "thermal": {"available": False},
        "fdr": {"enabled": True, "records_written": 4, "bytes_written": 2048},
        "bus": {"busy_poll": {"us": 50, "caught": 90, "missed": 10, "spent_us": 2_500_000}},
        "alerts": {},
    }
    text = "\n".join(cli_format.status(result))
    assert "50 us after each reply: caught 90, missed 10, 2.50 s spent" in text
    short = {**result, "bus": {"busy_poll": {"us": 50, "caught": 1, "missed": 2, "spent_us": 130}}}
    assert "caught 1, missed 2, 0.1 ms spent" in "\n".join(cli_format.status(short))
    assert re.search(r"busy poll: +off", "\n".join(cli_format.status({**result, "bus": {}})))
    assert "send buffer: the kernel's default" in text
    sized = {"bytes": 2 << 20, "sized": 3, "capped": 0, "effective_bytes": 2 << 20}
    sized_text = "\n".join(cli_format.status({**result, "bus": {"send_buffer": sized}}))
    assert "send buffer: 2.0 MiB asked, 3 connections sized" in sized_text
    assert "capped" not in sized_text
    capped = {**sized, "capped": 3, "effective_bytes": 208 << 10}
    capped_text = "\n".join(cli_format.status({**result, "bus": {"send_buffer": capped}}))
    assert "3 connections sized, 3 capped at 208.0 KiB (net.core.wmem_max)" in capped_text
    assert "onnx_trt_ep (fallback from tensorrt)" in text
    assert "DEADLINE_EXCEEDED=1" in text and "1.50 ms" in text and "4.20 ms" in text
    assert "det: reason: no engine for this host" in text
    assert "None" not in text and "True" not in text and "{" not in text
    assert all(line == line.rstrip() for line in text.splitlines())


def test_health_shows_each_models_queued_requests() -> None:
    reply = {
        "state": "serving",
        "uptime_s": 3,
        "thermal": "nominal",
        "threads": {"bus": True},
        "models": {"demo": {"state": "serving", "runtime": "onnx_trt_ep", "queue_depth": 3}},
    }
    lines = cli_format.health(reply)
    heading = next(line for line in lines if line.startswith("MODEL"))
    row = next(line for line in lines if line.startswith("demo"))
    assert heading.split() == ["MODEL", "STATE", "RUNTIME", "QUEUED"]
    assert row.split() == ["demo", "serving", "onnx_trt_ep", "3"]


def test_generic_documents_indent_maps_and_tabulate_lists() -> None:
    lines = cli_format.generic(
        {"build_id": "b1", "config": {"precision": "fp16"}, "rows": [{"k": 1}, {"k": 2}]}
    )
    assert lines == ["build_id: b1", "config:", "  precision: fp16", "rows:", "  k", "  1", "  2"]


def test_an_event_is_one_line() -> None:
    line = cli_format.event(
        "alert",
        {"ts_ns": 1_796_172_769_196_490_490, "level": "WARNING", "code": "x", "message": "m"},
    )
    assert "\n" not in line and line.endswith("alert    WARNING x: m")


def test_the_shm_line_says_the_kernels_huge_page_policy() -> None:
    shm = {"enabled": True, "regions": [], "mapped_bytes": 0, "max_bytes_total": 1 << 30}
    for policy in ("advise", "never"):
        text = "\n".join(cli_format.status({"models": [], "shm": {**shm, "huge_pages": policy}}))
        assert re.search(rf"^shm: 0 regions, .* connections, huge pages: {policy}$", text, re.M)


def test_the_shm_lines_name_descriptors_waiting_to_be_closed_only_when_some_do() -> None:
    shm = {"enabled": True, "regions": [], "mapped_bytes": 0, "max_bytes_total": 1 << 30}
    idle = {"waiting": 0, "closed": 12, "blocked_s": 0.0, "connections_closed_for_backlog": 0}
    text = "\n".join(cli_format.status({"models": [], "shm": {**shm, "closing": idle}}))
    assert "waiting to be closed" not in text
    stuck = {"waiting": 3, "closed": 12, "blocked_s": 41.5, "connections_closed_for_backlog": 1}
    text = "\n".join(cli_format.status({"models": [], "shm": {**shm, "closing": stuck}}))
    assert re.search(
        r"^  descriptors waiting to be closed: 3 \(the close in progress for 41.5 s\), "
        r"1 connections closed for it$",
        text,
        re.M,
    )


def test_status_shows_what_the_bounds_on_peers_refused() -> None:
    guard = {"limit": 65536, "threshold": 8192, "period_s": 0.1, "episodes": 2}
    security = {
        "switch_limit": {"burst": 10, "refill_s": 6.0, "refused": 7},
        "descriptor_guard": {**guard, "connections_ended": 4093},
    }
    text = "\n".join(cli_format.status({"models": [], "security": security}))
    assert re.search(
        r"^security: +switch rate limited 7 \(burst 10, one every 6 s\), descriptor guard: "
        r"2 floods, 4093 connections ended \(past 8192 of 65536 descriptors\)$",
        text,
        re.M,
    )
    before = {**security, "descriptor_guard": None}
    text = "\n".join(cli_format.status({"models": [], "security": before}))
    assert "switch rate limited 7 (burst 10, one every 6 s), descriptor guard not started" in text


def test_the_shm_lines_show_connections_per_uid_and_their_refusals() -> None:
    shm = {"enabled": True, "regions": [], "mapped_bytes": 0, "max_bytes_total": 1 << 30}
    per_uid = {"connections_by_uid": {"1001": 1, "1000": 8}, "max_connections_per_uid": 8}
    text = "\n".join(cli_format.status({"models": [], "shm": {**shm, **per_uid}}))
    assert re.search(
        r"^  connections per uid \(at most 8\): uid 1000: 8, uid 1001: 1; 0 refused over it$",
        text,
        re.M,
    )
    idle = {"connections_by_uid": {}, "max_connections_per_uid": 8, "refused_per_uid": 3}
    text = "\n".join(cli_format.status({"models": [], "shm": {**shm, **idle}}))
    assert "  connections per uid (at most 8): none; 3 refused over it" in text
