"""Which build summaries on disk a daemon concluded, and what a starting daemon does
with those no daemon did (DESIGN.md 219).

A build child writes its commit record (its summary marked ``provisional``) just
before it commits its engine, then its final summary; the daemon concludes the
build once the child has exited: it trusts a validated engine in the engine dir's
manifest (``child_exit``).  A daemon that dies first (SIGKILL, the OOM killer, a
power cut) never concludes it: its child, killed with the unit's cgroup or left
running, leaves a committed, validated engine that nothing trusts, so the next
run serves the fallback runtime until the model is built again (minutes on a
Jetson), and a commit record that says ``provisional`` for ever.

So each summary of a daemon build says who wrote it and who concludes it
(``writer``, the build process, and ``concluder``, the daemon that spawned it: pid,
the kernel's boot id and the process's start time, which no later process of that
boot has with that pid), and the daemon, when it concludes a build, writes the
summary again with its ``daemonConclusion`` (``conclude_on_disk``; one small
durable write per build).
At its start, before anything is served or pruned, the daemon concludes in the
engine dir every daemon build's summary that has a writer and a concluder, no
conclusion, and neither of them alive (``conclude_unconcluded``): an engine at the
final path with the digest the summary names and a matching sidecar was committed,
and is trusted like any (``record_trust``: only one that passed validation; a
simulated build's never, as the daemon never trusts one); a commit record
whose engine is not there names a commit that never happened and is removed; what
the dead child and other dead processes left (temp files, staging) is cleaned as the
daemon would have (``artifacts.clean_up``), but what a live process writes (another
daemon's or ``inferd build``'s build of that engine) is left, and so is an engine
being committed (``clean_up``'s ``left``).  The engine is hashed once: the commit check's
digest is passed on while its path names the very file hashed.  Each is logged and
recorded in the flight data recorder (``build_concluded_at_start``); a summary that
cannot be concluded is logged and the others still are.  A summary without a ``concluder``
(written before this, or for a daemon older than this that spawned a newer child
after an upgrade, which writes no conclusion) is never touched: its conclusion is
unknown, and trusting an engine an operator took out of the manifest would be
worse than rebuilding it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from inferd.digest import sha256_and_stat
from inferd.engine_build.artifacts import Hashed, clean_up, write_json
from inferd.engine_build.engine_outputs import SUMMARY_NAME, read_summary
from inferd.engine_build.pipeline import record_trust
from inferd.engines.manifest import MANIFEST_NAME
from inferd.engines.sidecar import read_sidecar
from inferd.errors import InferdError
from inferd.owned_files import unsafe_owned_dir_reason
from inferd.process_identity import still_running

log = structlog.get_logger("inferd.builds")

#: The FDR kind of a build concluded by a daemon other than the one that ran it.
CONCLUDED_AT_START = "build_concluded_at_start"


def names_a_commit(summary: Mapping[str, Any]) -> bool:
    """Whether ``summary``'s build committed its engine: ``completed``, and not with an
    engine that failed validation, which was quarantined instead (its summary says
    ``completed`` all the same; as ``engine_outputs`` reads it)."""
    return summary.get("outcome") == "completed" and summary.get("validationStatus") != "fail"


def committed(engine: Path, summary: Mapping[str, Any]) -> bool:
    """Whether the engine at ``engine`` (and its sidecar) is the one ``summary`` names:
    its digest, never through a symlink; anything else is not this build's commit."""
    return committed_as(engine, summary) is not None


def committed_as(engine: Path, summary: Mapping[str, Any]) -> Hashed | None:
    """``committed``, with the engine as hashed (its digest and the version of the file
    read: ``artifacts.still``), so that what follows need not hash it again."""
    digest = (summary.get("baseline") or {}).get("engineSha256")
    if not isinstance(digest, str) or not names_a_commit(summary):
        return None
    try:
        if read_sidecar(engine) != digest.lower():
            return None
        hashed = sha256_and_stat(engine)
    except (OSError, InferdError):
        return None
    return hashed if hashed[0] == digest.lower() else None


def conclude_on_disk(
    path: Path, summary: Mapping[str, Any], via: str, **facts: Any
) -> dict[str, Any]:
    """Write ``summary`` again at ``path`` with this daemon's conclusion (``via``:
    ``report``, ``after_child``, ``daemon_start``; ``facts``: trust and the like) and
    return it.  A commit record becomes a final summary (``provisional`` false).  A
    failure is logged: the build's end stands, and the next start concludes it
    again (trusting is idempotent)."""
    conclusion = {"via": via, "daemonPid": os.getpid(), "wallNs": time.time_ns(), **facts}
    document = {**summary, "provisional": False, "daemonConclusion": conclusion}
    try:
        write_json(path, document)
    except OSError as exc:
        log.error("build_conclusion_unwritten", summary=str(path), error=str(exc))
    return document


@dataclass(frozen=True)
class Concluded:
    """One summary a starting daemon concluded (its FDR record: ``as_record``)."""

    build_id: str
    engine: Path
    summary: Path
    #: ``trusted``, ``not_trusted`` (committed; see ``note``), ``not_committed``
    #: (a commit record whose commit never happened: removed), ``superseded`` (it
    #: committed an engine no longer at its path), ``ended`` (no commit).
    decision: str
    note: str
    outcome: str | None
    cleanup: dict[str, Any]

    def as_record(self) -> dict[str, Any]:
        return {
            "build_id": self.build_id,
            "engine": str(self.engine),
            "summary": str(self.summary),
            "decision": self.decision,
            "note": self.note,
            "outcome": self.outcome,
            "cleanup_status": self.cleanup.get("status"),
            "cleanup_left": self.cleanup.get("left", []),
        }


def conclude_unconcluded(
    engine_dir: Path,
    *,
    deployment_manifest: Path | None,
    record: Callable[[str, Mapping[str, Any]], None],
    may_trust: bool = True,
) -> list[Concluded]:
    """At the daemon's start: conclude every summary in ``engine_dir`` whose build no
    daemon concluded and whose writer is gone (the module doc).  ``may_trust``
    False: a builds dir's model folder, whose simulated builds are never trusted."""
    if unsafe_owned_dir_reason(engine_dir) is not None:
        return []  # missing, or not safely the daemon's: no build wrote there
    done = []
    for entry in sorted(os.scandir(engine_dir), key=lambda item: item.name):
        match = SUMMARY_NAME.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        path = Path(entry.path)
        summary = read_summary(path)
        if summary is None or "daemonConclusion" in summary:
            continue
        writer, concluder = summary.get("writer"), summary.get("concluder")
        if not isinstance(writer, dict) or not isinstance(concluder, dict):
            continue  # no daemon that writes its conclusions ran it: not known
        if summary.get("buildId") != match["build_id"]:
            continue  # another file's name
        if still_running(writer) or still_running(concluder):
            continue  # its child, or its daemon (another one's, on this dir), is there
        try:
            engine = engine_dir / match["engine"]
            concluded = _conclude(path, engine, summary, deployment_manifest, may_trust)
        except Exception:  # one damaged summary: the others are still concluded
            log.exception("build_conclusion_failed", summary=str(path))
            continue
        done.append(concluded)
        record(CONCLUDED_AT_START, concluded.as_record())
        log.warning("build_concluded_at_start", **concluded.as_record())
    return done


def _conclude(
    path: Path,
    engine: Path,
    summary: dict[str, Any],
    deployment_manifest: Path | None,
    may_trust: bool,
) -> Concluded:
    build_id, outcome = str(summary["buildId"]), summary.get("outcome")
    provisional = summary.get("provisional") is True
    hashed = committed_as(engine, summary)
    is_committed = hashed is not None
    # What the dead child (its pid may name another process now) and other dead
    # processes wrote and did not commit, as after a child's exit; a live process's
    # files are another build's, and an engine it commits is not to be quarantined.
    try:
        report = clean_up(engine, hashed=hashed).as_dict()
    except (OSError, InferdError) as exc:
        report = {"status": "failed", "removed": [], "quarantined": [], "errors": [str(exc)]}
        report["left"] = []
    if provisional and not is_committed:
        path.unlink(missing_ok=True)  # the link itself, never a target
        note = "its commit record names a commit that never happened: removed"
        return Concluded(build_id, engine, path, "not_committed", note, None, report)
    if not is_committed:
        conclude_on_disk(path, summary, "daemon_start", trusted=False)
        if names_a_commit(summary):
            note = "its engine is no longer at its path (replaced or removed since)"
            return Concluded(build_id, engine, path, "superseded", note, outcome, report)
        note = "no engine of this build is at its path"
        return Concluded(build_id, engine, path, "ended", note, outcome, report)
    facts: dict[str, Any] = {}
    if provisional:  # killed after its commit: its cleanup and timing cache not known
        facts["killedAfterCommit"] = True
        summary = {**summary, "cleanupStatus": report["status"], "cleanup": report}
    if summary.get("simulated") is not False or not may_trust:  # as a daemon concludes one
        note = "a simulated build: never trusted"
        conclude_on_disk(path, summary, "daemon_start", trusted=False, manifestNote=note, **facts)
        return Concluded(build_id, engine, path, "not_trusted", note, outcome, report)
    trust = record_trust(
        summary,
        engine,
        manifest=engine.parent / MANIFEST_NAME,
        deployment_manifest=deployment_manifest,
        hashed=hashed,
    )
    conclude_on_disk(
        path, summary, "daemon_start", trusted=trust.trusted, manifestNote=trust.note, **facts
    )
    decision = "trusted" if trust.trusted else "not_trusted"
    return Concluded(build_id, engine, path, decision, trust.note, outcome, report)
