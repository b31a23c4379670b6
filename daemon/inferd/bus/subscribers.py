"""What the events socket's subscribers may make the daemon hold (DESIGN.md 124).

The events socket is an XPUB in manual mode (``ZMQ_XPUB_MANUAL``): libzmq hands
every (un)subscription a subscriber sends to the publisher thread, which applies
it to that subscriber's connection only when it can match a published message.
A published message's first frame is its topic's name (``EventPublisher._send``),
and ZeroMQ matches a subscription as a prefix of that frame, so the only
subscriptions that can ever match are the prefixes of the topics' names, the
empty one (every topic) included: ``publisher.SUBSCRIBABLE``, 31 byte strings.
Applied subscriptions per connection are therefore at most those.

libzmq itself also keeps every subscription a connection sent in manual mode,
applied or not, until the connection ends (``xpub_t::_manual_subscriptions``, to
send unsubscriptions upstream when it does), and there is no call that drops it
or ends one connection of a bound socket.  So a connection that sends a
subscription that is refused, or anything that is not a subscription, is ended:
every connection of the events socket from the peer that sent it (libzmq's
``Peer-Address`` property of the message) is shut down
(``EndpointConnections.close_from``), which libzmq then handles as the peer
leaving, freeing what it kept.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The first byte of a subscription message, and of an unsubscription.
SUBSCRIBE = 1
UNSUBSCRIBE = 0


def subscribable(topics: Iterable[str]) -> frozenset[bytes]:
    """Every subscription that can match a message whose first frame is one of
    ``topics``: each prefix of each name, the empty one included."""
    return frozenset(
        name.encode()[:length] for name in topics for length in range(len(name.encode()) + 1)
    )
