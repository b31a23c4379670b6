"""ZeroMQ transport: wire codec, the ROUTER loop and the events publisher (an
XPUB in manual mode, DESIGN.md 124).

Knows nothing of runtimes: requests are handed to a ``RequestHandler`` that the
service implements.
"""
