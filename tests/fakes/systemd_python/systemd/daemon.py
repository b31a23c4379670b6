"""``systemd.daemon.notify`` as systemd-python 235 exposes sd_notify(3).

``notify(status, unset_environment=False, pid=0, fds=None) -> bool``: sends
``status`` to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract socket),
returns False when the variable is unset (sd_notify returns 0 then), raises
``OSError`` when sending fails (systemd-python turns a negative errno into an
exception).  ``pid`` and ``fds`` are not modelled: inferd never passes them.
"""

from __future__ import annotations

import os
import socket

#: Each call's state, so a test can see that this backend (not the built-in
#: sender) was used.
SENT: list[str] = []


def notify(status: str, unset_environment: bool = False, pid: int = 0, fds: object = None) -> bool:
    if pid or fds:
        raise NotImplementedError("the stand-in does not model pid/fds")
    address = os.environ.get("NOTIFY_SOCKET")
    if unset_environment:
        os.environ.pop("NOTIFY_SOCKET", None)
    if not address:
        return False
    target = "\0" + address[1:] if address.startswith("@") else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(target)
        sock.sendall(status.encode())
    SENT.append(status)
    return True
