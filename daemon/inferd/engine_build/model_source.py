"""The ONNX model a build is for: its path and the SHA-256 its engine is named by.

An engine's file name carries the digest ``engines/locate.py`` took of the model
(``inferd.engines.naming``); the build reads the model again later, seconds to
minutes after (TensorRT's parser, ONNX Runtime's reference for validation).  A
model file replaced in between (an operator copying a new model in, a
deployment tool) must never give an engine named and trusted as the old model
but built or validated from the new one.  So every consumer in a build reads the
model's bytes once, here, checks their digest against the one the engine is
named by, and uses exactly those bytes (``OnnxParser.parse(bytes, path)``,
``InferenceSession(bytes)``); a model that changed fails with
``ModelChangedError`` saying so.  The bytes are the caller's to drop once used:
a model can be hundreds of MB.

Not covered by the digest, here as in the engine's name: external data files
(weights beside the ``.onnx`` file, which TensorRT and ONNX Runtime read by path).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from inferd.digest import sha256_file
from inferd.errors import EngineBuildError
from inferd.owned_files import open_own_file


class ModelChangedError(EngineBuildError):
    """The model file no longer has the digest its engine is named by."""


@dataclass(frozen=True)
class ModelSource:
    """``path``: the operator's model (a symlink is followed, as ``locate_engine``
    hashed it); ``sha256``: the digest the engine's name carries."""

    path: Path
    sha256: str

    @property
    def parser_path(self) -> str:
        """The path TensorRT's parser resolves external weights against (the model
        file's; "Absolute path to the model file", ``NvOnnxParser.h``)."""
        return os.path.abspath(self.path)

    @property
    def directory(self) -> str:
        """The folder of the model's external data files."""
        return os.path.dirname(self.parser_path)

    def read(self) -> bytes:
        """The model's bytes, read once, whose digest is ``sha256``; ``OSError`` when
        it cannot be read, ``ModelChangedError`` when they are another model's."""
        handle, _info = open_own_file(self.path, follow=True)
        with handle:
            data = handle.readall()
        self._check(hashlib.sha256(data).hexdigest())
        return data

    def check_unchanged(self) -> None:
        """``ModelChangedError`` unless the file still has ``sha256`` (after something
        read it by path, for want of a way to hand it the bytes)."""
        self._check(sha256_file(self.path, follow=True))

    def _check(self, digest: str) -> None:
        if digest != self.sha256:
            raise ModelChangedError(
                f"the model file {self.path} changed during the build: its SHA-256 is now "
                f"{digest[:16]}, the engine is named for {self.sha256[:16]}; nothing is "
                "built or validated from another model than the one named: build again"
            )
