"""The routing ids libzmq's ROUTER generates (third review, A's finding 1).

A ROUTER gives a peer that sets no routing id ``0x00`` and a 32-bit counter, which
it starts at libc ``rand()`` and never checks against the ids peers claimed with
``ZMQ_ROUTING_ID``: a claimed id it then generates aborts the process.  Nothing
seeded ``rand()``, so every daemon generated the same ids, and ``status`` (and the
log) showed them, telling a client the ids to claim.  Now:

- ``bind_infer_and_control`` seeds ``rand()`` from the kernel before it makes the
  ROUTERs: two fresh processes' first generated ids differ (they were equal);
- ``status``'s ``bus.replies.dropping_peers`` and ``replies_dropped_peer_not_reading``
  show an id of that shape as a keyed digest, never raw; since review R2, every id:
  the clients choose 16 random bytes, and one shown raw could be claimed by
  whoever read ``status`` once its client had gone, with the replies still routed
  to it.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from structlog.testing import capture_logs

from inferd.bus.reply_budget import DIGEST_MARK, PEER_BUDGET, ReplyBudget
from tests.conftest import HANG_S, REPO

#: What libzmq generates for a peer that sets no routing id: 0x00 and a counter
#: (the first of an unseeded daemon's infer socket, and the next one).
GENERATED = [b"\x00\xe4\x3c\x98\x69", b"\x00\xe4\x3c\x98\x6a"]

#: A fresh process binds the bus's two ROUTERs and prints the id each generates
#: for its first peer (one that sets none), in hex.
FIRST_IDS = textwrap.dedent(
    """
    import sys
    import zmq
    from inferd.bus.binding import bind_infer_and_control
    from inferd.config import BusConfig
    from inferd_wire.send_buffer import SendBuffer

    at = sys.argv[1]
    endpoints = {"infer": f"ipc://{at}/infer.sock", "control": f"ipc://{at}/control.sock"}
    context = zmq.Context()
    config = BusConfig(*endpoints.values(), f"ipc://{at}/events.sock")
    routers = bind_infer_and_control(
        context, endpoints, 1 << 20, config, None, SendBuffer(endpoints["infer"], 0)
    )
    shown = []
    for router, endpoint in zip(routers, endpoints.values()):
        dealer = context.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send(b"hello")
        assert router.poll(10_000), "no message"
        shown.append(router.recv_multipart()[0].hex())
    print(" ".join(shown))
    """
)


def first_generated_ids(directory: Path) -> list[str]:
    directory.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IDS, str(directory)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_two_fresh_processes_generate_different_routing_ids(short_tmp_path: Path) -> None:
    """Unseeded, every process's ROUTERs generated the same ids (here 006b8b4567 and
    00e43c9869 for the first peer of each; in the daemon 00e43c9869 on the infer
    socket): a client claimed the next ones before they were handed out."""
    first, second = (first_generated_ids(short_tmp_path / run) for run in ("a", "b"))
    assert len(first) == len(second) == 2
    for shown in (*first, *second):
        assert re.fullmatch("00[0-9a-f]{8}", shown), shown  # a generated id
    assert first[0] != second[0] and first[1] != second[1], (first, second)


def test_status_and_the_log_show_a_generated_routing_id_as_a_keyed_digest() -> None:
    budget = ReplyBudget(per_peer_bytes=1, total_bytes=10)
    with capture_logs() as logs:
        for routing_id in GENERATED:
            budget.drop("infer", routing_id, 5, PEER_BUDGET)
    shown = [peer["peer"] for peer in budget.status()["dropping_peers"]]
    raw = [routing_id.hex() for routing_id in reversed(GENERATED)]
    assert all(routing_id not in peer for peer in shown for routing_id in raw), shown
    assert all(peer.startswith(DIGEST_MARK) for peer in shown), shown
    assert shown[0] != shown[1]  # two peers are still two
    # The journal's line names each peer as status does, so they can be matched.
    logged = [line["peer"] for line in logs if line["event"] == "replies_dropped_peer_not_reading"]
    assert logged == shown[::-1]
    # Keyed: without the daemon's key, no id can be tested against its digest.
    unkeyed = DIGEST_MARK + hashlib.blake2b(GENERATED[0], digest_size=8).hexdigest()
    assert unkeyed not in shown
    assert_valid_peer_ids(shown)


def test_ids_a_client_chose_are_shown_as_keyed_digests_too() -> None:
    """Shown raw (review R2), an id a client chose (inferd's clients choose 16
    random bytes) told whoever may read ``status`` the id to claim once that client
    had disconnected, and replies still routed to it would then go to the claimer."""
    budget = ReplyBudget(per_peer_bytes=1, total_bytes=10)
    chosen = [
        b"slow",
        b"\x01\xe4\x3c\x98\x69",
        b"\x00\xe4\x3c\x98",
        b"\x00" * 6,
        bytes(range(1, 17)),  # as inferd's clients choose: 16 bytes, the first not 0
        bytes(range(255)),
    ]
    with capture_logs() as logs:
        for routing_id in chosen:
            budget.drop("infer", routing_id, 5, PEER_BUDGET)
    shown = [peer["peer"] for peer in reversed(budget.status()["dropping_peers"])]
    assert all(peer.startswith(DIGEST_MARK) for peer in shown), shown
    assert all(routing_id.hex()[:8] not in peer for peer in shown for routing_id in chosen)
    assert len(set(shown)) == len(chosen)  # each peer still its own
    logged = [line["peer"] for line in logs if line["event"] == "replies_dropped_peer_not_reading"]
    assert logged == shown
    unkeyed = {DIGEST_MARK + hashlib.blake2b(r, digest_size=8).hexdigest() for r in chosen}
    assert not unkeyed & set(shown)
    assert_valid_peer_ids(shown)


def test_each_daemon_run_draws_its_own_key() -> None:
    """The same id reads differently in another run: a digest seen in one run's
    status tells nothing of the ids of the next."""
    show = (
        "from inferd.bus.reply_budget import shown_routing_id; "
        f"print(shown_routing_id({GENERATED[0]!r}))"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", show],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            cwd=REPO,
            check=True,
        ).stdout.strip()
        for _ in range(2)
    ]
    assert all(run.startswith(DIGEST_MARK) for run in runs), runs
    assert runs[0] != runs[1]


def assert_valid_peer_ids(shown: list[str]) -> None:
    schema = json.loads((REPO / "schemas/bus/status_reply.json").read_text())
    listed = schema["$defs"]["replies"]["properties"]["dropping_peers"]["items"]
    for peer in shown:
        assert re.fullmatch(listed["properties"]["peer"]["pattern"], peer), peer
