"""The bus sockets' protection as one piece the daemon starts and stops
(docs/SECURITY.md): the ZAP handler (``zap.py``) with the access policy
(``access.py``), CURVE on tcp:// when ``security.curve`` (``curve_keys.py``), the
descriptor guard against connections that never greet (``descriptor_guard.py``),
and what ``status`` reports about them.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import zmq

from inferd.bus.access import AccessPolicy
from inferd.bus.curve_keys import load_curve
from inferd.bus.descriptor_guard import DescriptorGuard, GuardLimits, soft_open_files_limit
from inferd.bus.zap import SocketSecurity, ZapHandler
from inferd.config import Config
from inferd.config.security import SOCKETS, is_loopback, tcp_host
from inferd.peer_rate_limit import PeerRateLimiter

log = structlog.get_logger("inferd.security")


class BusSecurity:
    def __init__(self, context: zmq.Context[Any], config: Config) -> None:
        self._context = context
        self._config = config
        self._endpoints = {
            "infer": config.bus.infer_endpoint,
            "control": config.bus.control_endpoint,
            "events": config.bus.events_endpoint,
        }
        tcp = frozenset(name for name, value in self._endpoints.items() if tcp_host(value))
        #: Applied by the bus and publisher threads to their sockets before they bind;
        #: the CURVE keys are filled in by ``start``.
        self.sockets = SocketSecurity(tcp_sockets=tcp)
        self.zap: ZapHandler | None = None
        self.guard: DescriptorGuard | None = None
        #: Decisions for local peers the kernel names (``shm.sock``'s, SO_PEERCRED).
        self._local = AccessPolicy(config.security, dict.fromkeys(SOCKETS, "ipc"), {})

    def local_refusal(self, socket: str, uid: int, gid: int, pid: int) -> str | None:
        """Why a local peer may not use what ``socket``'s allow-list guards (None:
        it may): ``shm.sock`` serves infer requests, under ``security.infer_allow``.
        When ``socket`` is on tcp://, where a peer proves a CURVE key, a local peer
        must be named by user or group (an empty list admits no one but root and
        the daemon's user): the file's permissions alone are less than a key."""
        refusal = self._local.local(socket, uid, gid, pid).refusal
        on_tcp = socket in self.sockets.tcp_sockets
        if refusal is None and on_tcp and not self._local.names_locally(socket, uid, gid):
            refusal = (
                f"the {socket} socket is tcp://: shm.sock admits only root, the daemon's "
                f"user and the users and groups security.{socket}_allow names"
            )
        return refusal

    def start(self) -> None:
        """Load the CURVE keys (when configured) and start the ZAP handler; raises
        (the daemon does not start) on any key or policy problem."""
        security = self._config.security
        clients: dict[bytes, str] = {}
        if security.curve:
            setup = load_curve(security)
            self.sockets.curve = setup.server
            clients = setup.clients
            if self.sockets.tcp_sockets and not clients:
                log.warning(
                    "curve_no_client_keys",
                    directory=str(security.curve_clients_dir),
                    hint="every CURVE client is refused; add one with: inferd keys client NAME",
                )
        for name in sorted(self.sockets.tcp_sockets):
            host = tcp_host(self._endpoints[name])
            if not security.curve and host is not None and is_loopback(host):
                log.warning(
                    "tcp_without_curve",
                    socket=name,
                    endpoint=self._endpoints[name],
                    risk="any local process of any user may connect; its requests carry no "
                    "verified identity and never have operator rights (security.curve = true)",
                )
        transports = {
            name: "tcp" if name in self.sockets.tcp_sockets else "ipc" for name in SOCKETS
        }
        policy = AccessPolicy(security, transports, clients)
        self.zap = ZapHandler(self._context, policy, self.sockets, self._config.bus.max_connections)
        self.zap.start()
        self.zap.wait_bound(timeout=10)
        # After the limit was raised (``open_files``): the guard's threshold derives from
        # it; one peer at the bound on every socket is never held to a share.
        max_connections = self._config.bus.max_connections
        limits = GuardLimits.of(soft_open_files_limit(), len(SOCKETS) * max_connections)
        self.guard = DescriptorGuard(self.sockets.connections, max_connections, limits)
        self.guard.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the descriptor guard, then the ZAP handler; ``timeout_s`` for both.
        After a failed ``start`` either may be a thread that never started (the
        process's thread limit, DESIGN.md 166): not joined, and the other is still
        stopped (the ZAP handler holds a socket of the context)."""
        deadline = time.monotonic() + timeout_s
        for thread in (self.guard, self.zap):
            if thread is None:
                continue
            thread.stop()
            if thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    def is_alive(self) -> bool:
        return self.zap is not None and self.zap.is_alive()

    def endpoints(self) -> list[str]:
        return list(self._endpoints.values())

    def socket_groups(self, shm_served: bool) -> list[tuple[str, str, int | None]]:
        """``(socket, endpoint, gid)``: the group each ipc:// socket file gets;
        ``shm.sock`` serves infer requests, so it gets the infer socket's (when it was
        bound: not under strict overcommit, DESIGN.md 295)."""
        security = self._config.security
        groups = [(name, self._endpoints[name], security.access(name).group) for name in SOCKETS]
        if shm_served:
            shm = f"ipc://{self._config.shm.socket}"
            groups.append(("infer", shm, security.access("infer").group))
        return groups

    def describe(self, permission_denied: int, switch_limit: PeerRateLimiter) -> dict[str, Any]:
        """``status.security``: each socket's mechanism and group, the connections
        the ZAP handler admitted and refused, the operator ops refused, and the
        ``runtime.switch`` rate per peer (``serving/switching.py``) with its refusals,
        and what the descriptor guard ended (None before the start)."""
        security = self._config.security
        counts = self.zap.describe() if self.zap is not None else {"accepted": {}, "refused": {}}
        held = self.zap.connection_counts() if self.zap is not None else {}
        return {
            "sockets": {
                name: {
                    "endpoint": self._endpoints[name],
                    "mechanism": self.sockets.mechanism(name),
                    "group": security.access(name).group_name,
                    "allow": [p.text for p in security.access(name).allow],
                    "connections_accepted": counts["accepted"].get(name, 0),
                    "connections_refused": counts["refused"].get(name, 0),
                    "connections": held.get(name, 0),
                }
                for name in SOCKETS
            },
            "max_connections": self._config.bus.max_connections,
            "operators": [p.text for p in security.operators],
            "permission_denied": permission_denied,
            "switch_limit": switch_limit.describe(),
            "descriptor_guard": self.guard.describe() if self.guard is not None else None,
        }
