"""The evidence bundle's derived parts: the cancel-latency table and ``report.md``."""

from __future__ import annotations

from typing import Any

from inferd.engine_build.acceptance.scenario import (
    LABEL,
    Scenario,
)


def latency_table(scenarios: list[Scenario]) -> list[dict[str, Any]]:
    rows = []
    for sc in scenarios:
        for build in sc.builds:
            if build.get("cancelSource"):
                rows.append(
                    {
                        "scenario": sc.name,
                        "builder": sc.notes.get("builder", LABEL),
                        "source": build["cancelSource"],
                        "requestToAckMs": build["cancelLatencyMs"],
                        "ackToCleanupMs": build["cleanupLatencyMs"],
                        "outcome": build["outcome"],
                    }
                )
    return rows


def report_markdown(evidence: dict[str, Any]) -> str:
    out = [
        f"# Stuck-build acceptance ({evidence['label']})",
        "",
        f"**Builder: {LABEL.upper()}** for every scenario labelled `{LABEL}` (the simulated "
        "builder drives the same progress-monitor adapter as the real one); "
        + (
            "no TensorRT on this host."
            if evidence["tensorrt"] is None
            else f"scenarios labelled `tensorrt` used TensorRT {evidence['tensorrt']}."
        ),
        "",
        f"Result: **{'PASS' if evidence['pass'] else 'FAIL'}** - "
        f"{evidence['passedCriteria']}/{evidence['totalCriteria']} criteria, "
        f"{evidence['durationS']} s.",
        "",
        "## Cancel latencies",
        "",
        "| scenario | builder | source | request->ack ms | ack->cleanup ms | outcome |",
        "|---|---|---|---|---|---|",
    ]
    for row in evidence["cancelLatencies"]:
        out.append(
            f"| {row['scenario']} | {row['builder']} | {row['source']} | {row['requestToAckMs']} | "
            f"{row['ackToCleanupMs']} | {row['outcome']} |"
        )
    for sc in evidence["scenarios"]:
        out += [
            "",
            f"## {'PASS' if sc['pass'] else 'FAIL'} - {sc['title']} (`{sc['name']}`, {LABEL})",
            "",
        ]
        if sc["error"]:
            out.append(f"Error: `{sc['error']}`")
        for c in sc["criteria"]:
            out.append(f"- [{'x' if c['pass'] else ' '}] {c['criterion']}")
        for b in sc["builds"]:
            out += [
                "",
                f"### {b['label']}",
                "",
                f"outcome `{b['outcome']}`, timing cache `{b['timingCacheMode']}`, cancel source "
                f"`{b['cancelSource']}`, request->ack {b['cancelLatencyMs']} ms, ack->cleanup "
                f"{b['cleanupLatencyMs']} ms, cleanup `{b['cleanupStatus']}`, retry "
                f"`{b['retryPolicy']}`, validation `{b['validationStatus']}`, eligible "
                f"{b['eligibleToServe']}",
                "",
                "Artifacts before: "
                + (", ".join(a["path"] for a in b["artifacts"]["before"]) or "(none)"),
                "",
                "Artifacts after: "
                + (", ".join(a["path"] for a in b["artifacts"]["after"]) or "(none)"),
                "",
                "Final phase tree:",
                "",
                "```",
                b["phaseTreeText"] or "(no phases)",
                "```",
            ]
            if b.get("cancelRequestedWallNs"):
                out += ["", f"Cancel requested at wall {b['cancelRequestedWallNs']} ns"]
            if b.get("signalToRequestMs") is not None:
                out += ["", f"Signal sent -> token set in the child: {b['signalToRequestMs']} ms"]
            if b.get("timingCache", {}).get("quarantinedTo"):
                out += [
                    "",
                    f"Timing cache quarantined to {b['timingCache']['quarantinedTo']}: "
                    f"{b['timingCache']['reason']}",
                ]
            if b.get("validation"):
                out += ["", f"Validation: {b['validation']['reason']}"]
            for snap in b.get("midBuildSnapshots", [])[:1]:
                out += ["", "Mid-build snapshot:", "", "```", snap["text"] or "(empty)", "```"]
            if b.get("stalls"):
                out.append("")
                out.append(
                    "Stalls: "
                    + "; ".join(
                        f"{' > '.join(s['path'])} (depth {s['depth']}, idle {s['idleS']} s)"
                        for s in b["stalls"]
                    )
                )
    return "\n".join(out) + "\n"
