"""Where the daemon's sockets live by default; shared by daemon and clients."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: A Unix socket path is limited to 107 bytes (sun_path); ``ipc://`` adds 6.
MAX_IPC_PATH_BYTES = 107


@dataclass(frozen=True)
class Endpoints:
    infer: str
    control: str
    events: str


def default_runtime_dir() -> Path:
    """Per-user directory for sockets: ``$INFERD_RUNTIME_DIR``, systemd's
    ``$RUNTIME_DIRECTORY``, ``$XDG_RUNTIME_DIR/inferd``, else ``/tmp/inferd-<uid>``."""
    for variable in ("INFERD_RUNTIME_DIR", "RUNTIME_DIRECTORY"):
        value = os.environ.get(variable)
        if value:
            return Path(value.split(":")[0])
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "inferd"
    return Path("/tmp") / f"inferd-{os.getuid()}"


def default_endpoints(runtime_dir: Path | None = None) -> Endpoints:
    base = runtime_dir if runtime_dir is not None else default_runtime_dir()
    return Endpoints(
        infer=f"ipc://{base / 'infer.sock'}",
        control=f"ipc://{base / 'control.sock'}",
        events=f"ipc://{base / 'events.sock'}",
    )
