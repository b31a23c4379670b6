"""ZeroMQ transport: wire codec, the ROUTER loop and the PUB publisher.

Knows nothing of runtimes: requests are handed to a ``RequestHandler`` that the
service implements.
"""
