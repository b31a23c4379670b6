"""Engine builds run by the daemon: ``build.start``, ``build.status``, ``build.cancel``.

Each build runs in a child process (``inferd.engine_build.child`` in a fresh
interpreter, started, killed and reaped by ``child_process.py``: it inherits no
ZeroMQ socket) while the resident engine keeps serving.  The child streams
``BuildEvent``s over a pipe (``pipe.py``); a reader thread per build folds them
into a ``PhaseTree`` (``build.status``) and publishes them on the ``build`` topic
as it kept them (``published_event.py``), coalescing ``step`` events (at most one
per build every ``STEP_PUBLISH_INTERVAL_S``; the rest are counted).  Cancelling
sends a message to the child, which sets its ``CancellationToken``; a child still
alive ``build_cancel_grace_s`` later is killed by the reader thread with its process
group, and the build is recorded as cancelled with ``escalated: true`` (status,
``build`` event, FDR record; rendered by ``build_record.py``).  At its deadline
(``builds.max_duration_s``, or a shorter ``timeout_s``) its reader thread cancels
it so, source ``timeout`` (both deadlines: ``reader_deadlines.py``).  A cancel
that comes once the child has exited is not accepted: its end is its own.
``build.start`` and ``build.cancel`` are operator ops (the verified ``Peer`` is recorded),
rate limited per peer; at most ``builds.max_running`` builds run at once
(``admission.py``); what builds leave is kept within the caps (``retention.py``).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import structlog

from inferd.config import BuildsConfig, ModelConfig
from inferd.engine_build import build_args, child_process, engine_path_claim
from inferd.engine_build.admission import BuildAdmission
from inferd.engine_build.build_args import parse_cancel, parse_start, tensorrt_importable
from inferd.engine_build.build_record import (
    Build,
    BuildFinished,
    describe,
    event_payload,
    fdr_record,
    said,
    said_refused,
    said_stalled,
    terminal_event,
)
from inferd.engine_build.child_exit import conclude, keep_ended, settle
from inferd.engine_build.events import TERMINAL_EVENTS
from inferd.engine_build.pipe import (
    CancelCommand,
    ChildMessage,
    EnginePathMessage,
    ErrorMessage,
    EventMessage,
    RecordMessage,
    ReportMessage,
    child_message_decoder,
    encode,
)
from inferd.engine_build.published_event import published
from inferd.engine_build.reader_deadlines import BuildDeadlines
from inferd.engine_build.session import BUILD_RECORD
from inferd.engine_build.status_view import listing_reply
from inferd.errors import ModelBuildRunningError, UncheckedDirectoryError, UnsafeDirectoryError
from inferd.owned_files import ensure_owned_dir
from inferd.types import Peer
from inferd_wire.protocol import Code, ProtocolError

log = structlog.get_logger("inferd.builds")

Publish = Callable[[str, Mapping[str, Any]], None]
Record = Callable[[str, Mapping[str, Any]], None]

STEP_PUBLISH_INTERVAL_S = 0.05
#: Finished builds kept for ``build.status`` (oldest forgotten first).
KEEP_FINISHED = 32


class BuildManager:
    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        *,
        build_dir: Path,
        engine_dir: Path,
        publish: Publish,
        record: Record,
        grace_s: float,
        tensorrt_available: Callable[[], bool] = tensorrt_importable,
        device_id: int = 0,
        gpu_memory_budget_bytes: int = 4 * 1024**3,
        engine_manifest: Path | None = None,
        on_finished: Callable[[BuildFinished], None] | None = None,
        limits: BuildsConfig | None = None,
        serving: Callable[[], Collection[Path]] = frozenset,
    ) -> None:
        self._models = models
        self._build_dir = build_dir
        self._engine_dir = engine_dir
        self._publish = publish
        self._record = record
        self.grace_s = grace_s
        self._tensorrt_available = tensorrt_available
        self._gpu = {"device_id": device_id, "gpu_memory_budget_bytes": gpu_memory_budget_bytes}
        self._on_finished = on_finished
        #: ``runtime.engine_manifest``: when set, a deployment-managed manifest that
        #: daemon builds never write (the operator adds the engine to it).
        self._engine_manifest = engine_manifest
        self._builds: dict[str, Build] = {}
        self._lock = threading.Lock()
        self._accepting = True
        self._counter = build_args.BuildCounter(build_dir, engine_dir)
        self._limits = limits = limits or BuildsConfig()
        self.max_duration_s = limits.max_duration_s
        self.admission = BuildAdmission(build_dir, limits, record, serving)
        self.admission.cover_engine_dir(engine_dir, engine_manifest, models)

    # -- control ops (bus thread) -------------------------------------------------
    def start(self, header: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """``build.start {model, build_config?, builder?, simulation?, timeout_s?,
        stall_after_s?}`` of ``peer``: returns at once."""
        limits, models, available = self._limits, self._models, self._tensorrt_available
        args = parse_start(header, models, available, limits.max_duration_s, limits.stall_after_s)
        model, builder, build_config = args.model, args.builder, args.build_config
        with self._lock:
            if not self._accepting:
                raise ProtocolError(Code.UNAVAILABLE, "the daemon is shutting down")
            running = [b for b in self._builds.values() if b.state == "running"]
            for other in running:
                if other.model == model:
                    raise ModelBuildRunningError(other.build_id, model)
            self.admission.room(peer, running)  # builds.max_running, before any change
            build_id = f"b{next(self._counter)}-{secrets.token_hex(3)}"
            engine_path = self._engine_path(model, builder, build_id)
            try:
                ensure_owned_dir(
                    engine_path.parent if builder == "simulated" else engine_path,
                    what="the build's directory",
                )
            except UnsafeDirectoryError as exc:
                # An operator's to fix (checked before the admission takes one of the
                # peer's starts); one that could not be checked (EMFILE) is transient.
                unchecked = isinstance(exc, UncheckedDirectoryError)
                code = Code.UNAVAILABLE if unchecked else Code.FAILED_PRECONDITION
                raise ProtocolError(code, str(exc)) from None
            incoming = self.admission.pending(build_id, model, builder, build_config, engine_path)
            self.admission.admit(peer, running, incoming)
            spec = build_args.child_spec(
                build_id, args, engine_path, self._engine_dir, self._gpu, limits
            )
            try:
                process = child_process.spawn(spec)
            except OSError as exc:
                self.admission.not_started(peer)
                reason = f"cannot start the build process: {exc}"
                raise ProtocolError(Code.INTERNAL, reason) from exc
            build = Build(
                build_id=build_id,
                model=model,
                builder=builder,
                build_config=build_config,
                engine_path=engine_path,
                process=process,
                requested_by=args.requested_by,
                peer=peer,
                started_wall_ns=time.time_ns(),
                started_mono=time.monotonic(),
                deadline_s=args.deadline_s,
                nonce=spec["nonce"],
                stall_after_s=args.stall_after_s,
                stall_cancels_after=limits.stall_cancels_after,
            )
            self._builds[build_id] = build
            self._forget_old()
        try:
            threading.Thread(
                target=self._follow, args=(build,), name=f"inferd-build-{build_id}", daemon=True
            ).start()
        except RuntimeError as exc:  # can't start new thread: nobody would read or reap it
            self._abandon(build, str(exc))
            raise ProtocolError(Code.INTERNAL, f"cannot follow the build process: {exc}") from exc
        log.info(
            "build_started",
            build_id=build_id,
            model=model,
            builder=builder,
            pid=process.pid,
            requested_by=args.requested_by,
            peer=peer.as_record(),
            deadline_s=args.deadline_s,
            stall_after_s=args.stall_after_s,
            **build_config,
        )
        return {
            "build_id": build_id,
            "model": model,
            "builder": builder,
            "simulated": builder == "simulated",
            "pid": process.pid,
            "engine_path": str(engine_path),
            "build_config": build_config,
            "deadline_s": args.deadline_s,
        }

    def status(self, header: dict[str, Any]) -> dict[str, Any]:
        """``build.status {build_id?}``: one build (with its phases), or all known builds
        (each with its tree's brief); within the reply a client reads (``status_view``)."""
        build_id = header.get("build_id")
        if build_id is None:
            with self._lock:
                builds = list(self._builds.values())
            rest = {
                "tensorrt_available": self._tensorrt_available(),
                "cancel_grace_s": self.grace_s,
                "max_duration_s": self.max_duration_s,
                **self.admission.describe(),
                "running_limit": self.admission.running_limit(
                    sum(1 for b in builds if b.state == "running")
                ),
            }
            return listing_reply([describe(b, listed=True) for b in builds], rest)
        return {"build": describe(self._get(build_id))}

    def cancel(self, header: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """``build.cancel {build_id, source?}`` of ``peer``: cooperative, killed after the grace."""
        build = self._get(header.get("build_id"))
        source, reason = parse_cancel(header)
        first = self._request_cancel(build, source, reason, peer)
        return {
            "build_id": build.build_id,
            "state": build.state,
            "accepted": first,
            "cancel_source": build.cancel_source,
            "grace_s": self.grace_s,
        }

    # -- shutdown (main thread) ------------------------------------------------------
    def shutdown(self, source: str = "sigterm", wait_s: float | None = None) -> None:
        """Cancel every running build with ``source`` (all killed the grace period
        after) and wait for their records: ``wait_s`` for all (default: grace + 10 s)."""
        with self._lock:
            self._accepting = False
            running = [b for b in self._builds.values() if b.state == "running"]
        for build in running:
            self._request_cancel(build, source, "the daemon is stopping", None)
        deadline = time.monotonic() + (self.grace_s + 10 if wait_s is None else wait_s)
        for build in running:
            if not build.done.wait(max(0.0, deadline - time.monotonic())):
                log.error("build_not_finished_at_shutdown", build_id=build.build_id)

    def tensorrt_available(self) -> bool:
        """Whether ``builder: auto`` builds with TensorRT here (else simulated)."""
        return self._tensorrt_available()

    def running(self) -> int:
        with self._lock:
            return sum(1 for b in self._builds.values() if b.state == "running")

    def prune(self, trigger: str) -> None:
        """Keep what builds leave within the caps (at start, after each build); a failure
        is logged (the next build.start prunes again, or refuses)."""
        with self._lock:
            running = [b for b in self._builds.values() if b.state == "running"]
        try:
            self.admission.prune(running, trigger)
        except Exception:
            log.exception("builds_prune_failed", trigger=trigger)

    # -- internals ------------------------------------------------------------------
    def _get(self, build_id: object) -> Build:
        if not isinstance(build_id, str):
            raise ProtocolError(Code.INVALID_ARGUMENT, "'build_id' must be a string")
        with self._lock:
            build = self._builds.get(build_id)
        if build is None:
            raise ProtocolError(Code.NOT_FOUND, f"no build {build_id!r}")
        return build

    def _engine_path(self, model: str, builder: str, build_id: str) -> Path:
        if builder == "simulated":
            # Never in the engine dir: a simulated engine must not look adoptable.
            return self._build_dir / model / f"{model}.{build_id}.simulated.engine"
        # The child names the file as the tensorrt runtime would (host tuple in the name).
        return self._engine_dir

    def _forget_old(self) -> None:
        finished = [b for b in self._builds.values() if b.state != "running"]
        for build in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._builds[build.build_id]

    def _abandon(self, build: Build, error: str) -> None:
        """A build whose reader thread could not start: its child killed and reaped,
        the build forgotten (the request failed), the peer's start given back."""
        log.error("build_reader_failed", build_id=build.build_id, error=error)
        with build.lock:  # reaped under it, as by the reader: no escalation after
            build.exit_code = child_process.reap(build.process)
            build.state = build.tree.state = "failed"
        child_process.close_pipes(build.process)
        with self._lock:
            self._builds.pop(build.build_id, None)
        self.admission.not_started(build.peer)
        build.done.set()
        self._ended(build)

    def _request_cancel(self, build: Build, source: str, reason: str, peer: Peer | None) -> bool:
        with build.lock:
            # Once the child has exited there is nothing to cancel: its end is its own.
            if build.state != "running" or build.cancel_source or build.exit_code is not None:
                return False
            build.cancel_source, build.cancel_reason = source, reason
            build.cancel_requested_mono = time.monotonic()
            build.cancel_peer = peer
        log.info(
            "build_cancel_requested",
            build_id=build.build_id,
            source=source,
            reason=reason,
            peer=None if peer is None else peer.as_record(),
        )
        try:
            stdin = build.process.stdin
            if stdin is not None:
                stdin.write(encode(CancelCommand(source, reason)))
                stdin.flush()
        except (OSError, ValueError) as exc:
            log.warning("build_cancel_pipe_failed", build_id=build.build_id, error=str(exc))
        return True  # its reader kills it after the grace (``BuildDeadlines``)

    def _deadline_passed(self, build: Build) -> None:
        """Cancelled as by an operator, source ``timeout`` (killed after the grace)."""
        bound = "builds.max_duration_s" if build.deadline_s == self.max_duration_s else "timeout_s"
        reason = f"the build ran past its deadline of {build.deadline_s:g} s ({bound})"
        if self._request_cancel(build, "timeout", reason, None):
            log.warning(
                "build_deadline_exceeded",
                build_id=build.build_id,
                model=build.model,
                deadline_s=build.deadline_s,
                grace_s=self.grace_s,
            )

    def _follow(self, build: Build) -> None:
        """Reader thread: the child's messages until EOF, then its exit (keeping the
        build's deadlines meanwhile: ``BuildDeadlines``), then the final record."""
        stdout = build.process.stdout
        assert stdout is not None
        decoder = child_message_decoder(build_id=build.build_id)
        deadlines = BuildDeadlines(build, self.grace_s, self._deadline_passed)
        try:
            while True:
                deadlines.act()  # each turn: a child always with something to say too
                if not child_process.readable(build.process, deadlines.wait_s()):
                    continue
                chunk = os.read(stdout.fileno(), 65536)
                if not chunk:
                    break
                for message in decoder.feed(chunk):
                    self._on_message(build, message)
        except Exception:
            log.exception("build_reader_failed", build_id=build.build_id)
        finally:
            if decoder.broken is not None:
                build.error = f"the build process's messages could not be read: {decoder.broken}"
            deadlines.await_exit()
            with build.lock:  # no escalation between the reap and the exit code
                build.exit_code = code = child_process.reap(build.process)
                build.exited_mono = time.monotonic()
            child_process.close_pipes(build.process)
            try:
                self._finish(build, code)
            except Exception:
                log.exception("build_finish_failed", build_id=build.build_id)
                if settle(build):  # ended here: still with its terminal event
                    self._publish_event(build, terminal_event(build, build.state, code))
            finally:
                settle(build)
                self._ended(build)

    def _on_message(self, build: Build, message: ChildMessage) -> None:
        if isinstance(message, EventMessage):
            event = message.event
            with build.lock:
                build.received += 1
                if not build.tree.apply(event):  # a cycle, or past the tree's bounds
                    said_refused(build, event)  # logged once a build for each cause
                    return  # not published either
                if event.type == "stalled":
                    said_stalled(build, event)  # logged; build.status's last_stall
                data = published(build, event)  # as kept: the child's strings cut
                if data is not None and event.type == "step":
                    now = time.monotonic()
                    if now - build.last_step_publish < STEP_PUBLISH_INTERVAL_S:
                        build.coalesced_steps += 1
                        return
                    build.last_step_publish = now
            if event.type == "cancel_requested" and event.detail.get("source") == "stall":
                # The child's watchdog cancelled it: killed after the grace, as at a deadline
                self._request_cancel(build, "stall", str(said(event.detail.get("reason"))), None)
            if data is not None and event.type not in TERMINAL_EVENTS:  # those: _finish's
                self._publish_event(build, data)
        elif isinstance(message, EnginePathMessage):
            engine_path_claim.accept(build, message.path, self._engine_dir)
        elif isinstance(message, RecordMessage):
            build.record = message.payload
        elif isinstance(message, ReportMessage):
            build.summary, build.reported = message.summary, True
            build.summary_path = said(message.summary_path)  # as build.status shows it
            build.dropped_in_child = message.dropped_in_child
        elif isinstance(message, ErrorMessage):
            build.error = said(message.error)  # kept as build.status shows it

    def _publish_event(self, build: Build, data: Mapping[str, Any]) -> None:
        payload = event_payload(build, data)
        build.published += 1
        self._publish("build", payload)

    def _finish(self, build: Build, code: int) -> None:
        state = conclude(build, self._engine_dir, self._engine_manifest)
        # Before the terminal event: whoever saw it sees the builds dir within its caps.
        self.prune(f"build {build.build_id} finished")
        self._record(BUILD_RECORD, fdr_record(build))
        terminal = terminal_event(build, state, code)
        self._publish_event(build, terminal)
        level = log.warning if state != "completed" else log.info
        level(
            "build_finished",
            build_id=build.build_id,
            model=build.model,
            state=state,
            cancel_source=build.cancel_source,
            escalated=build.escalated,
            exit_code=code,
            summary=build.summary_path,
        )
        build.done.set()

    def _ended(self, build: Build) -> None:
        """``build`` left the running set, however (``_finish``, ``settle``, ``_abandon``):
        it keeps what ``build.status`` shows; ``on_finished`` is told (a rebuild's room)."""
        keep_ended(build)  # never raises: on_finished is told whatever happens
        if self._on_finished is not None:
            try:
                self._on_finished(BuildFinished.of(build))
            except Exception:  # the build's own record is already complete
                log.exception("build_finished_hook_failed", build_id=build.build_id)
