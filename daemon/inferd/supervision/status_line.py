"""systemd's one-line ``STATUS=``: what ``systemctl status inferd`` shows.

The daemon state (``starting 1/2``, ``serving``, ``degraded``, ``stopping
(draining 3 queued)``), then per model ``name=runtime`` with ``(fallback from
X)``, or its state (``loading``, ``failed``); `` thermal=throttling`` when the
GPU throttles.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from inferd.types import EngineHandle


@dataclass(frozen=True)
class ModelLine:
    """What the line says of one model."""

    state: str
    handle: EngineHandle | None
    configured_runtime: str


def format_status_line(
    state: str,
    models: Mapping[str, ModelLine],
    *,
    queued: int,
    throttling: bool,
) -> str:
    parts: list[str] = []
    for name, model in models.items():
        handle = model.handle
        if model.state == "serving" and handle is not None:
            text = f"{name}={handle.runtime_label}"
            if handle.is_fallback:
                text += f"(fallback from {model.configured_runtime})"
        else:
            text = f"{name}={model.state}"
        parts.append(text)
    if state == "starting":
        done = sum(1 for model in models.values() if model.state != "loading")
        state = f"starting {done}/{len(models)}"
    elif state == "stopping":
        state = f"stopping (draining {queued} queued)" if queued else "stopping"
    line = f"{state}: {' '.join(parts)}"
    return line + " thermal=throttling" if throttling else line
