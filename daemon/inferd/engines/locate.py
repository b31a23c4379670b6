"""Where a model's TensorRT engine is, or will be built: the first step of the
engine pipeline (locate -> compile -> validate -> record trust -> load).

An engine's file name encodes the model hash, host tuple and build-config hash
(``inferd.engines.naming``), so the engine for (model, host, config) has one
path per label.  ``locate_engine`` reuses an intact engine for this host under
any label (the gate's steps 1-4: name, host tuple, sidecar, digest); the
manifest (step 5) is the loader's business, since rebuilding cannot make an
engine trusted.  A file at the target path that fails steps 1-4 is
quarantined (``inferd.engines.quarantine``) so a build can take its place.

Nothing is trusted, and nothing moved, in an engine dir that is not safely the
daemon's own (``inferd.engines.engine_dir``): the plan is then ``to_build`` with
``untrusted`` saying why, as when no intact engine exists.  Engines there are
examined without following a symlink (the gate's default): a symlink at the
target path is refused, naming it, and quarantined.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import structlog

from inferd.digest import sha256_remembered
from inferd.engines.engine_dir import untrusted_engine_dir
from inferd.engines.gate import STEP_MANIFEST_DIGEST, explain
from inferd.engines.manifest import Manifest
from inferd.engines.naming import EngineName, engine_name_for
from inferd.engines.quarantine import quarantine
from inferd.errors import EngineBuildError
from inferd.types import BuildConfig, EngineCacheEntry, HostTuple

#: The runtime label of entries for TensorRT engine files.
TENSORRT_LABEL = "tensorrt"

log = structlog.get_logger("inferd.engines.locate")


@dataclass(frozen=True)
class EnginePlan:
    """``reused``: ``entry.artifact_path`` is an intact engine for this host;
    ``to_build``: the path a build must write (``quarantined``: what was moved
    out of the way first; ``untrusted``: why nothing in the engine dir was
    trusted, when it is not safely the daemon's own)."""

    entry: EngineCacheEntry
    engine_name: EngineName
    status: Literal["reused", "to_build"]
    host: HostTuple
    quarantined: Path | None = None
    untrusted: str | None = None


def locate_engine(
    model_path: Path,
    build_config: BuildConfig,
    *,
    engine_dir: Path,
    host: HostTuple,
    label: str | None = None,
    force: bool = False,
) -> EnginePlan:
    """The plan for ``model_path``'s engine (``force``: always ``to_build``)."""
    if not model_path.is_file():
        raise EngineBuildError(f"model file {model_path} does not exist")
    try:
        model_sha256 = sha256_remembered(model_path)  # an operator's file
    except OSError as exc:
        raise EngineBuildError(f"cannot read model {model_path}: {exc}") from exc
    name = engine_name_for(
        label=label or model_path.stem,
        model_sha256=model_sha256,
        host=host,
        build_config=build_config,
    )
    path = engine_dir / name.format()
    entry = EngineCacheEntry(
        runtime_label=TENSORRT_LABEL,
        artifact_path=path,
        model_path=model_path,
        model_sha256=model_sha256,
        build_config=build_config,
    )
    quarantined: Path | None = None
    untrusted = untrusted_engine_dir(engine_dir)
    if untrusted is not None:
        return EnginePlan(entry, name, "to_build", host, untrusted=untrusted)
    if not force:
        found, refusal = _find_intact(path, host, model_sha256, build_config)
        if found is not None:
            log.info("engine_reused", engine=str(found), model=str(model_path))
            return EnginePlan(replace(entry, artifact_path=found), name, "reused", host)
        if refusal is not None:
            quarantined = _move_aside(path, refusal)
    return EnginePlan(entry, name, "to_build", host, quarantined)


def _find_intact(
    path: Path, host: HostTuple, model_sha256: str, build_config: BuildConfig
) -> tuple[Path | None, str | None]:
    """An intact engine for this model/host/config (any label), and why the file
    at ``path`` itself was unusable (None if it was usable or absent)."""
    rest = path.name.split("_", 1)[1]
    candidates = [path] if os.path.lexists(path) else []
    with contextlib.suppress(OSError):
        candidates += sorted(other for other in path.parent.glob(f"*_{rest}") if other != path)
    refusal: str | None = None
    for candidate in candidates:
        verdicts = explain(
            candidate,
            host=host,
            manifest=Manifest.empty(),
            model_sha256=model_sha256,
            build_config=build_config,
        )
        failed = [v for v in verdicts if v.step != STEP_MANIFEST_DIGEST and not v.passed]
        if not failed:
            return candidate, None
        if candidate == path:
            refusal = f"step {failed[0].number} ({failed[0].step}): {failed[0].message}"
    return None, refusal


def _move_aside(path: Path, reason: str) -> Path:
    try:
        target = quarantine(path, f"engine refused by the gate: {reason}")
    except OSError as exc:
        raise EngineBuildError(
            f"engine {path.name} is unusable ({reason}) and cannot be moved aside: {exc}"
        ) from exc
    log.warning("engine_quarantined", engine=str(path), moved_to=str(target), reason=reason)
    return target
