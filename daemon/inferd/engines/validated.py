"""An engine the gate passed (``ValidatedEngine``), and the one read of it that TensorRT
(or an EP-context model) gets: ``read_verified``.

The gate hashes the engine through one descriptor and records that descriptor's
``fstat``; the load reads the file again, into one buffer, hashing as it reads, so the
bytes deserialized are the bytes hashed whatever happened to the path in between.  A
file of another size than the gate's is refused before anything is allocated or read:
the GPU memory ledger charged the gate's size, and a file swapped in since may be any
size.  A refusal here is the gate's last step (``reread``): logged and recorded as
``engine_refused`` like the five before it, through the gate's ``refused`` hook.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from inferd.engines.naming import EngineName
from inferd.engines.sidecar import about_the_file, unchecked_engine
from inferd.errors import EngineHashMismatchError
from inferd.owned_files import open_own_file

#: The step a refusal at the re-read is logged and recorded under (after the five).
STEP_REREAD = "reread"
_READ_CHUNK = 1024 * 1024
#: ``refused(step, reason)``: the gate's ``engine_refused`` log line and FDR record.
RefusalHook = Callable[[str, str], None]


@dataclass(frozen=True)
class ValidatedEngine:
    """An engine the gate passed: what it is, its digest and the file identity it had.

    ``read_verified`` reads it for deserialization and re-checks the digest on
    the very bytes it returns, so a file swapped after the gate is refused."""

    path: Path
    name: EngineName
    sha256: str
    size_bytes: int
    mtime_ns: int
    inode: int
    device: int
    manifest_source: str
    follow: bool = False  # a staged engine: symlinks followed, as at the gate
    refused: RefusalHook | None = field(default=None, compare=False, repr=False)

    def unchanged(self) -> bool:
        """True while the file still has the size, mtime and inode it was validated with."""
        try:
            now = os.stat(self.path, follow_symlinks=self.follow)
        except OSError:
            return False
        return (now.st_size, now.st_mtime_ns, now.st_ino, now.st_dev) == (
            self.size_bytes,
            self.mtime_ns,
            self.inode,
            self.device,
        )

    def read_verified(self) -> bytearray:
        """The engine's bytes (one buffer, no extra copy), hashed as they are read;
        ``EngineHashMismatchError(stage="reread")`` if they are not the validated ones
        (a file of another size is refused unread); ``UncheckedEngineError`` if they
        could not be read for a reason that is not the file's (``sidecar.about_the_file``)."""
        digest = hashlib.sha256()
        changed = f"engine {self.path.name!r} changed after the gate validated it"
        try:
            handle, info = open_own_file(self.path, follow=self.follow)
            with handle:
                if info.st_size != self.size_bytes:
                    raise self._refusal(
                        f"{changed}: it has {info.st_size} bytes now, {self.size_bytes} when "
                        f"validated (validated sha256 {self.sha256})"
                    )
                buffer = bytearray(self.size_bytes)
                view = memoryview(buffer)
                offset = 0
                while offset < self.size_bytes:
                    count = handle.readinto(view[offset : offset + _READ_CHUNK])
                    if not count:
                        break
                    digest.update(view[offset : offset + count])
                    offset += count
                grew = bool(handle.read(1))
                view.release()
        except OSError as exc:
            if not about_the_file(exc):  # EMFILE, ENOMEM: no verdict, nothing recorded
                raise unchecked_engine(f"engine {self.path.name!r}", "re-read", exc) from exc
            raise self._refusal(
                f"engine {self.path.name!r} cannot be re-read after validation: {exc}"
            ) from exc
        if grew or offset != self.size_bytes or digest.hexdigest() != self.sha256:
            raise self._refusal(f"{changed} (validated sha256 {self.sha256})")
        return buffer

    def _refusal(self, reason: str) -> EngineHashMismatchError:
        if self.refused is not None:
            self.refused(STEP_REREAD, reason)
        return EngineHashMismatchError(reason, stage="reread")
