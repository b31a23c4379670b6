"""Timing-cache store: where a host's TensorRT timing cache lives and how it is written.

A timing cache records measured tactic timings.  It is valid for one GPU and
one TensorRT version (TensorRT checks a device header when it is set), not per
model or precision, so one file per host serves every build::

    <engine_dir>/timing_cc<major>.<minor>-<sku>_<platform>_trt<version>.cache

The file name never ends in ``.engine``, so the engine gate never looks at it.
This module only stores bytes (bounded read, atomic write); *whether* to reuse,
update, discard or quarantine a cache is the build session's timing-cache policy
(``inferd.engine_build.timing_cache_policy.TimingCacheManager``; the outcomes and what
each means: ``TimingCacheOutcome``).
"""

from __future__ import annotations

from pathlib import Path

import structlog

from inferd.durable import atomic_write_bytes
from inferd.owned_files import ensure_owned_dir, open_own_file
from inferd.types import HostTuple

TIMING_CACHE_SUFFIX = ".cache"
#: Timing caches grow with the number of distinct layers timed; far below this.
TIMING_CACHE_MAX_BYTES = 256 * 1024 * 1024

log = structlog.get_logger("inferd.engines.timing_cache")


def timing_cache_path(engine_dir: Path, host: HostTuple) -> Path:
    cc = host.compute_capability_text
    return engine_dir / (
        f"timing_cc{cc}-{host.gpu_sku}_{host.platform}_trt{host.tensorrt_version}"
        + TIMING_CACHE_SUFFIX
    )


class TimingCacheFile:
    """Load/store one timing cache file.  A missing or unreadable file loads as
    None (a cold cache: builds still succeed, only slower); writes are atomic."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> bytes | None:
        try:
            with open_own_file(self.path)[0] as handle:
                data = handle.read(TIMING_CACHE_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("timing_cache_unreadable", path=str(self.path), error=str(exc))
            return None
        if len(data) > TIMING_CACHE_MAX_BYTES:
            log.warning("timing_cache_oversized", path=str(self.path), bytes=len(data))
            return None
        return data or None

    def store(self, data: bytes) -> None:
        ensure_owned_dir(self.path.parent, what="the timing cache's directory")
        atomic_write_bytes(self.path, data)
