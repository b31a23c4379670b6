"""The ONNX model a build is for: its path and the digest its engine is named by.

An engine's file name carries the digest ``engines/locate.py`` took of the model
(``inferd.digest.model_digest``: of its file, and of its external data files when
it has some; ``inferd.engines.naming``); the build reads the model again later,
seconds to minutes after (TensorRT's parser, ONNX Runtime's reference for
validation).  A model file replaced in between (an operator copying a new model
in, a deployment tool) must never give an engine named and trusted as the old
model but built or validated from the new one.  So every consumer in a build
reads the model's bytes once, here, checks their digest against the one the
engine is named by, and uses exactly those bytes (``OnnxParser.parse(bytes,
path)``, ``InferenceSession(bytes)``, the inputs INT8 calibration batches are
checked against: ``calibration_batches.onnx_inputs``); a model that changed fails with
``ModelChangedError`` saying so.  The bytes are the caller's to drop once used:
a model can be hundreds of MB.

External data files (weights beside the ``.onnx`` file) cannot be handed over as
bytes: TensorRT's parser and ONNX Runtime read them by path.  They are hashed
with the model's bytes (``read``), and once the consumer has read them they are
checked again (``check_unchanged``): the same digest and the very files hashed
(each file's inode, size, mtime and ctime, so a swap undone before the check is
caught too); else ``ModelChangedError``.  The reading and the comparisons are
``inferd.model_bytes``'s, shared with ``onnx_trt_ep`` serving; the words are the
build's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from inferd.digest import ModelDigest, model_digest
from inferd.errors import EngineBuildError
from inferd.external_data import model_directory
from inferd.model_bytes import changed_part, read_model, replaced_files


class ModelChangedError(EngineBuildError):
    """The model file, or one of its external data files, no longer has the digest
    its engine is named by (or is no longer the very file hashed)."""


@dataclass(frozen=True)
class ModelSource:
    """``path``: the operator's model (a symlink is followed, as ``locate_engine``
    hashed it); ``sha256``: the digest the engine's name carries (``model_digest``)."""

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
        return model_directory(self.path)

    def read(self) -> tuple[bytes, ModelDigest]:
        """The model's bytes, read once, and what was hashed with them (its external
        data files too), whose digest is ``sha256``; ``OSError`` when the model or
        one of its files cannot be read or names a file outside its folder
        (``inferd.external_data``), ``ModelChangedError`` when it is another model."""
        data, hashed = read_model(self.path)
        if hashed.sha256 != self.sha256:
            raise self._changed(hashed.sha256, "")
        return data, hashed

    def check_unchanged(self, hashed: ModelDigest) -> None:
        """``ModelChangedError`` unless the model and its external data files are still
        the very files ``read`` hashed (``hashed``), with the digest ``sha256``: after
        something read them by path, for want of a way to hand it their bytes."""
        now = model_digest(self.path)
        if now.sha256 != self.sha256:
            raise self._changed(now.sha256, changed_part(hashed, now))
        replaced = replaced_files(hashed, now)
        if replaced:
            raise ModelChangedError(
                f"the model {self.path} changed during the build: {', '.join(replaced)} "
                "was written or replaced since the build hashed it (its content is the "
                "one named again, but what was read meanwhile is not known); nothing is "
                "built or validated from another file than the one hashed: build again"
            )

    def _changed(self, digest: str, which: str) -> ModelChangedError:
        return ModelChangedError(
            f"the model {self.path} changed during the build{which}: its digest is "
            f"now {digest[:16]}, the engine is named for {self.sha256[:16]}; nothing is "
            "built or validated from another model than the one named: build again"
        )
