"""Whether a ``build.start`` may start a build now: fewer builds running than
``builds.max_running`` (``room``), room under the builds cap (``retention.py``: the
builds dir and the engine dir's daemon-build outputs, ``engine_outputs.py``) and in
the peer's rate (``inferd.peer_rate_limit``).

``room`` runs first, before the build gets an id or a folder; the other two after
the op's arguments and preconditions; so a request refused for any changes nothing
and does not use up the peer's rate.  The daemon's own background rebuilds
(``Peer.internal``) have their own back-off and are not rate limited; they need
room on disk like any build (over the cap, only logged), and are held to
``max_running`` like any: refused ``RESOURCE_EXHAUSTED``, the only refusal of that
code they can meet, on which the rebuilder waits for a build to end.  Before each count
(at the daemon's start, each ``build.start``, after each build) the staging
folders of build processes that died are removed (``artifacts.sweep_staging``):
a killed build's staged engine is otherwise never counted nor removed.  At the
daemon's start, before that, the builds an earlier daemon never concluded (it
died first) are concluded (``commit_records.conclude_unconcluded``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import structlog

from inferd.config import BuildsConfig, ModelConfig
from inferd.engine_build.artifacts import sweep_staging
from inferd.engine_build.build_record import Build
from inferd.engine_build.commit_records import conclude_unconcluded
from inferd.engine_build.engine_outputs import EngineOutputs
from inferd.engine_build.retention import BuildsRetention, Pending
from inferd.engines.build_config import parse_build_config
from inferd.engines.naming import build_config_hash, sanitize_label
from inferd.peer_rate_limit import PeerRateLimiter
from inferd.types import Peer
from inferd_wire.protocol import Code, ProtocolError

log = structlog.get_logger("inferd.builds")

Record = Callable[[str, Mapping[str, Any]], None]
#: The prune at the daemon's start: it first concludes the builds an earlier run
#: did not (``commit_records``).
DAEMON_START = "daemon_start"


class BuildAdmission:
    def __init__(
        self,
        build_dir: Path,
        limits: BuildsConfig,
        record: Record,
        serving: Callable[[], Collection[Path]],
    ) -> None:
        self._build_dir = build_dir
        self._engine_dir: Path | None = None
        self._engine_manifest: Path | None = None
        self._record = record
        self._models: dict[str, ModelConfig] = {}
        self.retention = BuildsRetention(build_dir, limits.max_count, limits.max_bytes, record)
        self.max_running = limits.max_running
        #: ``build.start``s refused by ``max_running`` (the daemon's own included).
        self.running_refused = 0
        self.start_limit = PeerRateLimiter(
            "build.start",
            limits.start_burst,
            limits.start_refill_s,
            keys="builds.start_burst, builds.start_refill_s",
        )
        #: Engine files in use, never removed by the cap.
        self._serving = serving

    def cover_engine_dir(
        self,
        engine_dir: Path,
        engine_manifest: Path | None,
        models: Mapping[str, ModelConfig],
    ) -> None:
        """Count what TensorRT builds leave in ``engine_dir`` under the same caps
        (``engine_outputs.py``; ``engine_manifest``: ``runtime.engine_manifest``)."""
        self._engine_dir, self._models = engine_dir, dict(models)
        self._engine_manifest = engine_manifest
        paths = [model.path for model in self._models.values()]
        self.retention.engine_outputs = EngineOutputs(engine_dir, engine_manifest, lambda: paths)

    def pending(
        self, build_id: str, model: str, builder: str, build_config: Mapping[str, Any], engine: Path
    ) -> Pending:
        """What a build of ``model`` adds under the cap (``engine``: the path it writes,
        or the engine dir while a TensorRT child has not named its file yet)."""
        if builder == "simulated" or self._engine_dir is None or model not in self._models:
            return Pending(build_id, self._build_dir, model, engine=engine)
        config = parse_build_config(build_config, source="build.start")
        return Pending(
            build_id,
            self._engine_dir,
            sanitize_label(self._models[model].path.stem),  # the label the child names it by
            build_config_hash(config),
            engine=None if engine == self._engine_dir else engine,
        )

    def pending_of(self, build: Build) -> Pending:
        with build.lock:
            engine = build.engine_path
        return self.pending(build.build_id, build.model, build.builder, build.build_config, engine)

    def room(self, peer: Peer, running: Collection[Build]) -> None:
        """``RESOURCE_EXHAUSTED`` when ``running`` (the builds running now) already
        holds ``builds.max_running`` builds, naming them; changes nothing else."""
        if len(running) < self.max_running:
            return
        self.running_refused += 1
        names = ", ".join(f"{build.build_id} (model {build.model!r})" for build in running)
        log.warning(
            "build_start_over_max_running",
            peer=peer.as_record(),
            max_running=self.max_running,
            running=[build.build_id for build in running],
        )
        raise ProtocolError(
            Code.RESOURCE_EXHAUSTED,
            f"builds.max_running is {self.max_running} and {len(running)} builds are "
            f"running: {names}; wait for one to end (build.status, build.follow), cancel "
            "one (build.cancel), or raise builds.max_running",
        )

    def running_limit(self, running: int) -> dict[str, int]:
        """``build.status``'s ``running_limit``: the cap, the builds running, and the
        starts it refused over this run."""
        return {
            "max_running": self.max_running,
            "running": running,
            "refused": self.running_refused,
        }

    def admit(
        self, peer: Peer, running: Collection[Build], incoming: Pending | None = None
    ) -> None:
        """Take one of ``peer``'s starts for ``incoming``, or ``RESOURCE_EXHAUSTED``
        saying why not (``running``: the running builds, whose files stay).  The
        daemon's own rebuilds (an internal peer) are neither capped nor rate limited."""
        self.sweep_staging()
        serving = self._serving()
        pending = [self.pending_of(build) for build in running]
        left = self.retention.prune(keep=pending, serving=serving, trigger="build.start")
        full = self.retention.over_caps(left, [*pending, *filter(None, [incoming])], serving)
        if peer.transport == "internal":
            # The daemon's own rebuild after a fallback: recovery is never held up by
            # the cap on what builds leave (at most rebuild_max_attempts per model).
            if full is not None:
                log.warning("builds_over_cap_for_rebuild", reason=full)
            return
        if full is not None:
            raise ProtocolError(Code.RESOURCE_EXHAUSTED, full)
        wait_s = self.start_limit.retry_after(peer.key)
        if wait_s is not None:
            log.warning("build_start_rate_limited", peer=peer.as_record(), retry_after_s=wait_s)
            raise self.start_limit.refusal(peer, wait_s)
        self.start_limit.take(peer.key)

    def not_started(self, peer: Peer) -> None:
        """``admit`` took one of ``peer``'s starts for a build that did not start."""
        if peer.transport != "internal":
            self.start_limit.give_back(peer.key)

    def prune(self, running: Collection[Build], trigger: str) -> None:
        if trigger == DAEMON_START:
            # Before the sweep and the caps: an engine trusted now is pinned by them.
            for folder in self._build_folders():
                try:  # only TensorRT builds, in the engine dir, are ever trusted
                    conclude_unconcluded(
                        folder,
                        deployment_manifest=self._engine_manifest,
                        record=self._record,
                        may_trust=folder == self._engine_dir,
                    )
                except Exception:  # a folder unreadable: the sweep and the caps still run
                    log.exception("build_conclusion_failed", directory=str(folder))
        self.sweep_staging()
        pending = [self.pending_of(build) for build in running]
        self.retention.prune(keep=pending, serving=self._serving(), trigger=trigger)

    def sweep_staging(self) -> None:
        """Remove dead build processes' staging in the engine dir and each model's
        builds folder (a simulated build stages beside its engine); a few listings
        and lock probes: a live build's folder is locked, and left."""
        for folder in self._build_folders():
            removed, errors = sweep_staging(folder)
            if removed or errors:
                log.warning(
                    "build_staging_swept", directory=str(folder), removed=removed, errors=errors
                )

    def _build_folders(self) -> list[Path]:
        """Where builds write: the engine dir (TensorRT builds) and each model's
        folder of the builds dir (simulated builds)."""
        folders = [self._engine_dir] if self._engine_dir is not None else []
        with contextlib.suppress(OSError):  # no builds dir yet
            folders += [p for p in self._build_dir.iterdir() if p.is_dir() and not p.is_symlink()]
        return folders

    def describe(self) -> dict[str, Any]:
        return {"retention": self.retention.describe(), "start_limit": self.start_limit.describe()}
