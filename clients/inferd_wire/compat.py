"""What Python 3.11 added that the wire package and the daemon use, for 3.10
(JetPack 6 ships Python 3.10 with NVIDIA's TensorRT bindings for it)."""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:

    class StrEnum(str, enum.Enum):
        """``enum.StrEnum`` of 3.11: members are strings and ``str()`` is the value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


__all__ = ["StrEnum"]
