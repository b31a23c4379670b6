"""How the bus's ROUTER sockets are made and bound, and a socket thread's bind
outcome, handed to the thread that started it.

The daemon reports ready only once every socket is bound, and a bind failure
(address in use, a bad endpoint, a refused security option) must surface in the
starting thread as the exception itself, not end quietly with the socket thread.

A ROUTER gives a peer that sets no routing id one it generates: 0x00 and a 32-bit
counter, started at libzmq's ``generate_random()`` (two libc ``rand()`` calls) when
the socket is made.  libzmq never seeds ``rand()`` (its ``seed_random`` has no
caller in the build pyzmq bundles), so every daemon handed out the same ids
(``00e43c9869``, ``00e43c986a``... on the infer socket), and it does not check
that a peer has not claimed the id it generates with ``ZMQ_ROUTING_ID``:
``add_out_pipe`` asserts and the process aborts.  A local client that claimed the
next ids aborted the daemon at the next ordinary connection, after every restart.
So the ROUTERs are made just after ``rand()`` is seeded from the kernel
(``seed_generated_routing_ids``; SECURITY.md, "What is not protected").
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog
import zmq

from inferd.config import BusConfig
from inferd_wire.endpoints import wants_ipv6
from inferd_wire.send_buffer import SendBuffer

if TYPE_CHECKING:  # zap.py binds its own socket with BindOutcome
    from inferd.bus.zap import SocketSecurity

log = structlog.get_logger("inferd.bus")

#: Messages per peer pipe.  Reply bytes are bounded by the ReplyBudget; this
#: bounds the count of small ones (libzmq's default).
ROUTER_SNDHWM = 1000
ROUTER_RCVHWM = 10_000


def seed_generated_routing_ids() -> None:
    """Seed libc's ``rand()``, the one libzmq's ``generate_random()`` calls
    (``rand@GLIBC_2.2.5``, resolved in the process's global scope, as ``CDLL(None)``
    resolves ``srand``), from the kernel: a ROUTER made next starts the routing ids
    it generates at an unpredictable point, instead of ``00e43c9869`` in every
    daemon (see the module doc)."""
    srand = ctypes.CDLL(None).srand
    srand.argtypes = [ctypes.c_uint]
    srand.restype = None
    srand(int.from_bytes(os.urandom(4), "little"))


def bound_router(
    context: zmq.Context[Any],
    endpoint: str,
    max_message_bytes: int,
    config: BusConfig,
    secure: Callable[[zmq.Socket[Any]], None] | None,
    send_buffer: SendBuffer | None = None,
) -> zmq.Socket[Any]:
    """A ROUTER with the bus's options, ``secure`` applied (ZAP, CURVE), bound;
    ``send_buffer`` sizes its connections' kernel send buffers from the bind on
    (else they keep the kernel's default)."""
    sock: zmq.Socket[Any] = context.socket(zmq.ROUTER)
    # Refuse oversize frames at the transport (the peer is disconnected); the codec
    # checks the whole message again.  ZeroMQ drops the connection of a peer whose
    # frame exceeds MAXMSGSIZE, with no reply; at twice the limit, one oversized
    # tensor still gets its error.
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, ROUTER_SNDHWM)
    sock.setsockopt(zmq.RCVHWM, ROUTER_RCVHWM)
    # A peer silent after a PING (its process frozen, its host gone) is
    # disconnected and its pipe, with the replies queued to it, freed.
    sock.setsockopt(zmq.HEARTBEAT_IVL, config.heartbeat_interval_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, config.heartbeat_timeout_ms)
    sock.setsockopt(zmq.IPV6, wants_ipv6(endpoint))
    try:
        if secure is not None:
            secure(sock)
        if send_buffer is not None:
            # Before the bind: the monitor reports every connection accepted after it.
            send_buffer.watch(sock)
        sock.bind(endpoint)
    except BaseException:
        if send_buffer is not None:
            send_buffer.close()
        sock.close(linger=0)
        raise
    return sock


def bind_infer_and_control(
    context: zmq.Context[Any],
    endpoints: Mapping[str, str],
    max_message_bytes: int,
    config: BusConfig,
    security: SocketSecurity | None,
    send_buffer: SendBuffer,
) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """The bus's infer and control ROUTERs, bound, ``send_buffer`` watching the
    infer socket's connections; on a failure neither stays open."""
    # Just before the sockets are made: each ROUTER draws its counter's start then.
    seed_generated_routing_ids()
    bound: list[zmq.Socket[Any]] = []
    try:
        for name in ("infer", "control"):
            secure = None if security is None else partial(security.apply, name)
            # Control messages are small: the kernel's default takes each whole.
            sizes = send_buffer if name == "infer" else None
            bound.append(
                bound_router(context, endpoints[name], max_message_bytes, config, secure, sizes)
            )
            if security is not None:
                security.bound(name, bound[-1])
    except BaseException:
        send_buffer.close()
        for sock in bound:
            sock.close(linger=0)
        raise
    return bound[0], bound[1]


def size_new_connections(send_buffer: SendBuffer) -> None:
    """Size the kernel send buffer of the connections the monitor reported
    (DESIGN.md 116); a size the kernel capped is logged once."""
    capped = send_buffer.capped
    send_buffer.apply()
    if send_buffer.capped and not capped:
        log.warning(
            "send_buffer_capped",
            asked_bytes=send_buffer.nbytes,
            effective_bytes=send_buffer.effective_bytes,
            hint="raise net.core.wmem_max (systemd/inferd.sysctl) or lower bus.send_buffer_bytes",
        )


class BindOutcome:
    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._settled = threading.Event()
        self._error: BaseException | None = None

    def bound(self) -> None:
        self._settled.set()

    def failed(self, error: BaseException) -> bool:
        """The thread cannot serve: its start fails with ``error``; False once it
        was bound (the start has succeeded, the error is the thread's own)."""
        if self._settled.is_set():
            return False
        self._error = error
        self._settled.set()
        return True

    def wait(self, timeout: float) -> None:
        """Return once bound; raise the bind failure, or ``TimeoutError``."""
        if not self._settled.wait(timeout):
            raise TimeoutError(f"{self._thread_name} did not bind in time")
        if self._error is not None:
            raise self._error
