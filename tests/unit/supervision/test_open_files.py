"""The daemon raises its soft ``RLIMIT_NOFILE`` to the hard one at start and warns
when three sockets of ``bus.max_connections`` and the reserve do not fit
(``supervision/open_files.py``, DESIGN.md 128).  Each case runs in a child
process, whose limits it may lower without touching the test run's."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.conftest import REPO

CHILD = """
import json, resource, sys
from pathlib import Path
import structlog
events = []
structlog.configure(processors=[lambda _l, _m, event: events.append(event) or ""],
                    logger_factory=structlog.ReturnLoggerFactory())
soft, hard, connections = (int(value) for value in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
from inferd.config import ShmConfig
from inferd.supervision.open_files import raise_open_files_limit
shm = ShmConfig(socket=Path("/run/inferd/shm.sock"), enabled=False)
if len(sys.argv) > 4:
    shm_connections, regions = (int(value) for value in sys.argv[4:6])
    shm = ShmConfig(socket=Path("/run/inferd/shm.sock"), max_connections=shm_connections,
                    max_regions_per_connection=regions)
limit = raise_open_files_limit(connections, shm)
print(json.dumps({"limit": limit, "now": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "events": [event["event"] for event in events],
                  "needed": [event.get("needed") for event in events]}))
"""


def run(
    soft: int, hard: int, max_connections: int, shm: tuple[int, int] | None = None
) -> dict[str, Any]:
    """``raise_open_files_limit`` in a child with these limits; ``shm``: its
    ``shm.max_connections`` and ``max_regions_per_connection`` (None: disabled)."""
    shm_args = [] if shm is None else [str(value) for value in shm]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(soft), str(hard), str(max_connections), *shm_args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    result = run(256, 4096, 256)
    assert result["limit"] == 4096 and result["now"] == [4096, 4096]
    assert result["events"] == ["open_files_limit"]


def test_a_limit_too_low_for_the_sockets_is_said() -> None:
    result = run(256, 1500, 256)  # 3 x 256 + 1024 = 1792 needed
    assert result["limit"] == 1500
    assert result["events"] == ["open_files_limit_low"]
