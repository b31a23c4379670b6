"""The events socket's topics: the one list the daemon publishes under
(``inferd.bus.publisher``) and the clients check a subscription against.

A published message's first frame is its topic's name and ZeroMQ matches a
subscription as a prefix of it, so the daemon applies exactly the empty
subscription (every topic) and the prefixes of these names, and closes every
events connection of a subscriber that sends anything else (DESIGN.md 124): a
client refuses such a topic before it connects.
"""

from __future__ import annotations

from inferd_wire.protocol import MAX_HEADER_BYTES

TOPICS: frozenset[str] = frozenset({"thermal", "runtime", "build", "alert", "health"})
#: The largest event payload a client takes, and the daemon publishes: a reply
#: header's bound, since the daemon's events carry what its control replies do
#: (``health``, a build's state).
MAX_EVENT_BYTES = MAX_HEADER_BYTES


def check_topic(topic: str) -> str:
    """``topic`` when the daemon applies a subscription to it (a topic's name, a
    prefix of one, or "" for every topic); else ``ValueError`` naming the topics."""
    if any(name.startswith(topic) for name in TOPICS):
        return topic
    raise ValueError(
        f"unknown event topic {topic!r}; known: {', '.join(sorted(TOPICS))} "
        "(or a prefix of one; none for every topic)"
    )
