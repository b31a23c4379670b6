"""The engine path a build child names (``EnginePathMessage``), believed only where
the daemon would have put the engine itself.

The daemon acts on that path: ``child_exit.clean_after`` quarantines a file there
with no matching sidecar (and removes dead processes' temp files beside it),
``trust`` records it in the manifest, ``build.status`` shows it.  The decoder
checks a message's types only, so a child that named the served ONNX model got
the daemon to move it into ``models/quarantine/`` (review G, F2).  So a path is
taken only when it is:

* for a simulated build, the one the daemon chose (``BuildManager._engine_path``);
* for a TensorRT build, a file directly in the engine dir whose name follows the
  engine naming schema (``parse_engine_name``: it ends in ``.engine``), and the
  first the child named (or that one again).

Any other is ignored: the build keeps the daemon's path (for a TensorRT build the
engine dir, which ``child_exit.after_child`` never cleans), the refusal is logged
(``build_engine_path_refused``) and the build ends ``failed`` with it as its error
(``child_exit.conclude``), its engine never trusted.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from inferd.alerts.sanitise import escaped
from inferd.engine_build.build_record import Build
from inferd.engines.naming import parse_engine_name
from inferd.errors import EngineSchemaMismatchError

log = structlog.get_logger("inferd.builds")

#: Bytes of UTF-8 of the named path quoted in the error and the log.
_SHOWN_PATH_BYTES = 512


def refusal(build: Build, named: str, engine_dir: Path) -> str | None:
    """Why ``named`` is not ``build``'s engine path, or None when it is."""
    path = Path(named)
    shown = escaped(named, _SHOWN_PATH_BYTES)
    if build.simulated:
        if path == build.engine_path:
            return None
        return (
            f"the build process named {shown!r} as its engine, not {str(build.engine_path)!r}, "
            "the path the daemon chose for this simulated build"
        )
    if path.parent != engine_dir:
        return f"the build process named an engine outside {str(engine_dir)!r}: {shown!r}"
    if build.engine_path not in (engine_dir, path):
        return (
            f"the build process named a second engine, {shown!r}, after {str(build.engine_path)!r}"
        )
    try:
        parse_engine_name(path.name)
    except EngineSchemaMismatchError as exc:
        return f"the build process named an engine that is not one: {escaped(str(exc), 1024)}"
    return None


def accept(build: Build, named: str, engine_dir: Path) -> None:
    """``build``'s child named ``named`` as its engine: taken, or refused (logged;
    the build's error until it ends, and then its cause of failure)."""
    why = refusal(build, named, engine_dir)
    with build.lock:
        if why is None:
            build.engine_path = Path(named)
            return
        build.engine_path_refused = build.engine_path_refused or why
        build.error = build.engine_path_refused
    log.error("build_engine_path_refused", build_id=build.build_id, model=build.model, error=why)
