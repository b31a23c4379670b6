"""A real daemon bounds what a subscriber sending valid (un)subscriptions without
end makes it hold (DESIGN.md 124).

Before, a subscription that can match a topic was always applied, and libzmq
took every connection's messages into one queue of the events socket faster
than the publisher thread read them: a process with 8 connections alternating
``health`` and its unsubscription grew the daemon by hundreds of MiB in seconds,
nothing refused, counted or logged.  Now its peer is past its rate within the
first few hundred: refused, counted, logged, and its connections ended.  The
flood runs in a child process, since the daemon ends every events connection of
the process it refuses; this one's subscriber must be served throughout.
"""

from __future__ import annotations

import json
import subprocess
import sys

from inferd_client import OperatorClient
from tests.conftest import HANG_S, REPO, DaemonFactory, Events, memory_kib, wait_until

#: Memory the daemon may gain meanwhile: the allocator's own growth.
RSS_MARGIN_BYTES = 64 << 20
CONNECTIONS = 8
FLOOD_S = 5.0

#: 8 raw ZMTP connections sending health/unsubscribe health back to back for up
#: to FLOOD_S, or until the daemon closed them all; prints how many it closed.
_FLOODER = """
import json, select, sys, time
from tests.events_peers import zmtp_connect

endpoint, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
frame = lambda message: b"\\x00" + bytes([len(message)]) + message
toggle = frame(b"\\x01health") + frame(b"\\x00health")
chunk = toggle * (65536 // len(toggle))
open_ = [zmtp_connect(endpoint) for _ in range(count)]
for conn in open_:
    conn.setblocking(False)
closed = 0
end = time.monotonic() + seconds
while open_ and time.monotonic() < end:
    _, writable, _ = select.select([], open_, [], 0.1)
    for conn in writable:
        try:
            conn.send(chunk)
        except BlockingIOError:
            pass
        except OSError:
            open_.remove(conn)
            conn.close()
            closed += 1
print(json.dumps({"closed": closed}), flush=True)
"""


def test_a_flood_of_valid_subscriptions_is_refused_and_the_daemon_stays_bounded(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    with Events(daemon.events) as events:
        before = memory_kib(daemon) * 1024
        flooder = subprocess.run(
            [sys.executable, "-c", _FLOODER, daemon.events, str(CONNECTIONS), str(FLOOD_S)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=FLOOD_S + HANG_S,
            check=True,
        )
        grown = memory_kib(daemon) * 1024 - before
        assert json.loads(flooder.stdout)["closed"] == CONNECTIONS, (
            f"the daemon kept the flooding connections open (it grew {grown >> 20} MiB)"
        )
        assert grown < RSS_MARGIN_BYTES, f"the daemon grew {grown >> 20} MiB"
        events.settle()  # this process's subscriber is still served
    with OperatorClient(daemon.control, timeout=HANG_S) as operator:
        refused = operator.status()["bus"]["events_subscriptions_refused"]
    assert refused >= 1
    wait_until(
        lambda: "more (un)subscriptions than its rate" in daemon.log(),
        message="the refusal logged",
    )
    assert daemon.process.poll() is None
