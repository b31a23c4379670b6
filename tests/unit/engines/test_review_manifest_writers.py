"""The manifest's one writer reads, changes and rewrites ``manifest.json``; two
processes doing it at once (the daemon recording a build it validated while an
operator's ``inferd build --manifest`` records another, or the builds cap dropping an
entry) must not lose each other's change.

Found by review: the lock was a ``threading.Lock``, so a second process's write made
from the entries it had read before the first one's rename dropped that entry: a
validated engine the daemon had just recorded was refused at step 5 after it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

from inferd.engines import Manifest
from inferd.engines.manifest import MANIFEST_NAME, record_in_manifest
from tests.conftest import HANG_S, wait_until

DIGEST_A = hashlib.sha256(b"a").hexdigest()
DIGEST_B = hashlib.sha256(b"b").hexdigest()

#: Records a.engine, stopping after it has read the manifest until its stdin closes.
_WRITER = """
import sys
from pathlib import Path
from inferd.engines import manifest

real = manifest.write_manifest
def held(path, entries):
    Path(sys.argv[2]).touch()  # it has read the entries it will write
    sys.stdin.read()
    real(path, entries)
manifest.write_manifest = held
manifest.record_in_manifest(Path(sys.argv[1]), "a.engine", sys.argv[3])
"""


def _waiting_on_a_lock_of(directory: Path) -> bool:
    """Whether a lock request on ``directory`` waits (``/proc/locks`` shows ``->``)."""
    inode = f":{directory.stat().st_ino} "
    with open("/proc/locks") as locks:
        return any("->" in line and inode in line for line in locks)


def test_two_processes_recording_at_once_keep_both_entries(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    engines.mkdir(mode=0o750)
    path = engines / MANIFEST_NAME
    loaded = tmp_path / "loaded"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), str(loaded), DIGEST_A],
        stdin=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        wait_until(loaded.exists, message="the other writer reading the manifest")
        second = threading.Thread(target=record_in_manifest, args=(path, "b.engine", DIGEST_B))
        second.start()
        # Either it is done (nothing kept it from writing over the other one's change)
        # or it waits for the other writer's lock.
        wait_until(
            lambda: not second.is_alive() or _waiting_on_a_lock_of(engines),
            message="the second writer done or waiting",
        )
    finally:
        assert writer.stdin is not None
        writer.stdin.close()
        assert writer.wait(HANG_S) == 0
    second.join(HANG_S)
    assert not second.is_alive()
    assert Manifest.load(path).entries() == {"a.engine": DIGEST_A, "b.engine": DIGEST_B}
