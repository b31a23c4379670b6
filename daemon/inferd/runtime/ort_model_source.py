"""What an ``onnx_trt_ep`` session is made of: the very model its digest names.

``compile_engine`` hashes the model (and its external data files); the session is
made afterwards.  ONNX Runtime given the model's path read whatever the path named
then, so weights replaced in between were served under the old model's digest,
which names the TensorRT EP's cache and gates a staged engine; asking the digest
again after the load (DESIGN.md 201) did not see a change undone meanwhile (A to B
to A).  So the model's bytes are read once (``inferd.model_bytes``), their digest
checked to be the entry's, and the session made from exactly those bytes.

ONNX Runtime still reads external data files by path: from the model's folder,
named by ``session.model_external_initializers_file_folder_path`` (1.21 on; given
bytes, an earlier ONNX Runtime looks beside its working directory).  Once the
session exists they must still be the very files hashed (inode, size, mtime,
ctime: a rename over one and back moves its ctime).  Before 1.21 a model with
external data is loaded from its path, and the model file is checked so too; so
is it for a session that asks for the TensorRT EP, whose parser is handed the
subgraph's initializers by ONNX Runtime: that it finds external weights of a model
given as bytes is not yet confirmed on a GPU (a device check, DESIGN.md).
Either way a model changed meanwhile loads nothing (``EngineDeserializeError``).

A staged engine's EP-context model is not read here: it holds the gated engine's
bytes, not the model's weights, is written by the daemon into its own cache
directory, which only its user may change, and stays loaded by path, how the real
TensorRT EP takes a context model otherwise being unconfirmed (DESIGN.md 154).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.digest import ModelDigest
from inferd.errors import EngineDeserializeError
from inferd.external_data import model_directory
from inferd.model_bytes import MODEL_FILE, model_file_replaced, read_model, replaced_external_files
from inferd.types import EngineCacheEntry

#: ONNX Runtime's session option (1.21 on) naming the folder of a model's external
#: data when the model is given as bytes; earlier versions ignore the key.
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"
_EXTERNAL_DATA_FOLDER_SINCE = (1, 21)


@dataclass(frozen=True)
class SessionModel:
    """``source``: what ``InferenceSession`` is given, the bytes read (the model's
    path before ONNX Runtime 1.21 for a model with external data); ``hashed``: the
    files their digest, the entry's, was taken over.  Held only while the session is
    made: the bytes can be hundreds of MB."""

    path: Path
    source: bytes | Path
    hashed: ModelDigest

    def configure(self, options: Any) -> None:
        """Point ONNX Runtime's ``options`` at the folder of the model's external data."""
        if self.hashed.external and isinstance(self.source, bytes):
            options.add_session_config_entry(EXTERNAL_DATA_FOLDER, model_directory(self.path))

    def check_read(self) -> None:
        """Once the session is made: refuse it unless every file ONNX Runtime read by
        path is still the very file hashed (stat only: nothing is read again)."""
        replaced = replaced_external_files(self.path, self.hashed)
        if isinstance(self.source, Path) and model_file_replaced(self.path, self.hashed):
            replaced.insert(0, MODEL_FILE)
        if replaced:
            raise EngineDeserializeError(
                f"model {self.path} changed while ONNX Runtime loaded it ({', '.join(replaced)} "
                "was written or replaced since it was hashed for this load): nothing was "
                "loaded from it; load it again"
            )


def read_session_model(entry: EngineCacheEntry, ort: Any, *, tensorrt_ep: bool) -> SessionModel:
    """The model of ``entry`` read once for ONNX Runtime ``ort``: refused unless its
    digest is still ``entry.model_sha256``.  ``tensorrt_ep``: the session asks for the
    TensorRT EP, which is given a model with external data by path (below)."""
    path = entry.model_path
    try:
        data, hashed = read_model(path)
    except OSError as exc:
        raise EngineDeserializeError(f"cannot read model {path}: {exc}") from None
    if hashed.sha256 != entry.model_sha256:
        raise EngineDeserializeError(
            f"model {path} changed since it was hashed for this load (its digest is now "
            f"{hashed.sha256[:16]}, not {entry.model_sha256[:16]}): nothing was loaded from "
            "it; load it again"
        )
    if hashed.external and (tensorrt_ep or not external_data_from_memory(ort)):
        return SessionModel(path, path, hashed)
    return SessionModel(path, data, hashed)


def external_data_from_memory(ort: Any) -> bool:
    """Whether ONNX Runtime ``ort`` finds the external data of a model given as bytes
    in the folder ``EXTERNAL_DATA_FOLDER`` names (1.21 on, onnxruntime PR #23557)."""
    found = re.match(r"(\d+)\.(\d+)", str(getattr(ort, "__version__", "")))
    return found is not None and (int(found[1]), int(found[2])) >= _EXTERNAL_DATA_FOLDER_SINCE
