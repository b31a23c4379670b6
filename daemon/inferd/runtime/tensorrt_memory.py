"""The GPU memory budget of TensorRT engines.  ``runtime.gpu_memory_budget_bytes`` bounds what the
TensorRT engines of one GPU hold in this process, summed over every runtime
instance (a process-wide ledger per device): during a make-before-break switch
old and new engine really are resident together.  An engine is charged its
file size before deserialization (an estimate of its weights), then file size +
``device_memory_size_v2`` (activations; ``device_memory_size`` on TensorRT
without it) + its IO buffers.  A refusal raises ``OutOfMemoryError`` and leaves
everything resident as it was.  ONNX Runtime's own arena is not counted.
"""

from __future__ import annotations

import threading


def mib(nbytes: int) -> str:
    return f"{nbytes / (1024 * 1024):.1f} MiB"


class GpuMemoryLedger:
    """Bytes charged against the GPU memory budget, per resident engine, for one device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._charges: dict[object, int] = {}

    def charge(self, key: object, nbytes: int, budget: int) -> tuple[bool, int]:
        """Set ``key``'s charge to ``nbytes`` if everything fits in ``budget``.
        Returns (accepted, bytes charged to the other keys)."""
        with self._lock:
            others = sum(value for owner, value in self._charges.items() if owner is not key)
            if others + nbytes > budget:
                return False, others
            self._charges[key] = nbytes
            return True, others

    def settle(self, key: object, nbytes: int) -> None:
        """Set ``key``'s charge to what it really holds, ``nbytes``, without a budget
        check: after a growth charged in advance failed.  A key not charged (released)
        stays so."""
        with self._lock:
            if key in self._charges:
                self._charges[key] = nbytes

    def release(self, key: object) -> None:
        with self._lock:
            self._charges.pop(key, None)

    def used(self) -> int:
        with self._lock:
            return sum(self._charges.values())

    def engines(self) -> int:
        with self._lock:
            return len(self._charges)


_LEDGERS: dict[int, GpuMemoryLedger] = {}
_LEDGERS_LOCK = threading.Lock()


def ledger_for(device_id: int) -> GpuMemoryLedger:
    with _LEDGERS_LOCK:
        return _LEDGERS.setdefault(device_id, GpuMemoryLedger())
