"""Review of entry 225's zone fix (``endpoint_connections._scope_id``).

libzmq names a link-local peer with ``getnameinfo`` (``NI_NUMERICHOST``): glibc
writes the zone as the interface's *name* (``if_indextoname``), whatever that name
is.  ``_scope_id`` reads a zone made of digits as an index without asking
``if_nametoindex``, so on an interface whose name is all digits (Linux allows any
name without ``/``, ``:`` or blanks; ``ip link set eth1 name 2``) the zone ``5`` of
the interface ``5`` (index 1 here) is read as index 5: ``close_from`` ends none of
the peer's connections and a CURVE peer's exact count misses its own.  glibc's own
parser of zones (``__inet6_scopeid_pton``) asks for the name first, then a number.
"""

from __future__ import annotations

from pathlib import Path

from tests.unit.bus.test_review_220_222 import in_a_namespace

REPO = Path(__file__).resolve().parents[3]

#: Run inside ``unshare -rn``, ``lo`` renamed ``5`` (index 1) with ``fe80::1/64``.
_SCRIPT = """
import json, zmq
from inferd.bus.endpoint_connections import EndpointConnections
context = zmq.Context()
router = context.socket(zmq.ROUTER)
router.setsockopt(zmq.IPV6, 1)
router.setsockopt(zmq.RCVTIMEO, 10_000)
router.bind("tcp://[fe80::1%1]:*")  # libzmq reads a zone of digits as an index
endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
dealer = context.socket(zmq.DEALER)
dealer.setsockopt(zmq.IPV6, 1)
dealer.setsockopt(zmq.LINGER, 0)
port = endpoint.rsplit(":", 1)[1]
dealer.connect(f"tcp://[fe80::1%1]:{port}")  # the endpoint says %5: the name
dealer.send(b"subscription no topic matches")
frames = router.recv_multipart(copy=False)
address = frames[1].get("Peer-Address")
connections = EndpointConnections(endpoint)
found = {"address": address, "exact": connections.count_from(address, exact=True)}
found["closed"] = connections.close_from(address)
print(json.dumps(found))
dealer.close()
router.close(linger=0)
context.term()
"""


def test_a_link_local_peer_on_an_interface_named_with_digits_is_found() -> None:
    found = in_a_namespace(
        "ip link set lo name 5 && ip link set 5 up && ip -6 addr add fe80::1/64 dev 5 nodad",
        _SCRIPT,
        "cannot rename lo in a namespace",
    )
    assert found["address"] == "fe80::1%5"  # glibc's zone: the interface's name
    assert found["exact"] == 1, "a CURVE peer's exact count missed its own connection"
    assert found["closed"] == 1, "close_from ended none of the link-local peer's connections"
