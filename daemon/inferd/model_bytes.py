"""A model's bytes, read once with what was hashed, and the files read by path checked after.

Whoever hashed a model (``inferd.digest``) and then has something else read it by
path (TensorRT's parser, ONNX Runtime), seconds to minutes later, may get another
model's weights under the digest: a file replaced in between, even one replaced and
put back (A to B to A), which a new hash cannot see.  So the consumer reads the
model's bytes once (``read_model``), checks their digest against the one it knows
the model by, and hands over exactly those bytes.

External data files (weights beside the ``.onnx`` file) are hashed with those bytes
but read by path by the consumer: once it has read them they must still be the very
files hashed (``replaced_files``: each file's inode, size, mtime and ctime; a write,
a rename over it and one back all move the ctime, which no one but root can set
back).  Each user words its own error: a build fails (``engine_build.model_source``),
an ``onnx_trt_ep`` load is refused (``runtime.ort_model_source``).

What a consumer decides from the model's graph before or beside that (its inputs,
its Q/DQ nodes) is read from the same bytes (``parse_model``), never from the path
again: a file replaced meanwhile would have it decide for another model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from inferd.digest import FileVersion, ModelDigest, file_version, model_digest_of
from inferd.external_data import model_directory, open_external_file
from inferd.owned_files import open_own_file

#: What a message calls the model file itself.
MODEL_FILE = "the model file"


def read_model(path: Path) -> tuple[bytes, ModelDigest]:
    """The bytes of the model at ``path`` (a symlink followed: an operator's file), read
    once through one descriptor, and the digest taken over them and over its external
    data files, each with the version of the file hashed.  ``OSError`` when the model
    or one of its files cannot be read or names a file outside its folder
    (``inferd.external_data``)."""
    handle, info = open_own_file(path, follow=True)
    with handle:
        data = handle.readall()
    return data, model_digest_of(data, path, info)


def parse_model(data: bytes) -> Any:
    """``data`` (bytes ``read_model`` read) as an ``onnx.ModelProto``, without reading
    its external data files; raises what onnx raises for bytes that are not one
    (protobuf's ``DecodeError``, ...).  As large in memory as ``data`` when the
    weights are inline: callers keep what they read of it, not the proto."""
    import onnx  # heavy: only where a decision needs the graph

    return onnx.load_model_from_string(data)


def changed_part(hashed: ModelDigest, now: ModelDigest) -> str:
    """`` (its external data file w.bin)`` naming what differs, or nothing when the
    model file itself (or the list of its files) changed."""
    was = {file.location: file.sha256 for file in hashed.external}
    is_ = {file.location: file.sha256 for file in now.external}
    if hashed.file_sha256 != now.file_sha256 or was.keys() != is_.keys():
        return ""
    changed = sorted(location for location, digest in was.items() if is_[location] != digest)
    return f" (its external data file {', '.join(changed)})" if changed else ""


def replaced_files(hashed: ModelDigest, now: ModelDigest) -> list[str]:
    """The files ``now`` was taken over that are not the very files ``hashed`` was
    (``MODEL_FILE``, ``its external data file w.bin``), in order."""
    was, is_ = _versions(hashed), _versions(now)
    return [file for file, version in was.items() if is_.get(file) != version]


def replaced_external_files(path: Path, hashed: ModelDigest) -> list[str]:
    """The external data files of the model at ``path`` that are no longer the very
    files ``hashed`` was taken over (or cannot be opened now), without reading them:
    one no-follow open and ``fstat`` each (``open_external_file``)."""
    directory = model_directory(path)
    replaced = []
    for file in hashed.external:
        try:
            handle, info = open_external_file(directory, file.location)
        except OSError:
            version: FileVersion | None = None
        else:
            handle.close()
            version = file_version(info)
        if version != file.version:
            replaced.append(f"its external data file {file.location}")
    return replaced


def model_file_replaced(path: Path, hashed: ModelDigest) -> bool:
    """Whether the file ``path`` names (a symlink followed) is no longer the very model
    file ``hashed`` was taken over, or cannot be stat'ed."""
    try:
        return file_version(os.stat(path)) != hashed.version
    except OSError:
        return True


def _versions(digest: ModelDigest) -> dict[str, FileVersion]:
    """The version of each file ``digest`` was taken over, by what a message calls it."""
    external = {f"its external data file {file.location}": file.version for file in digest.external}
    return {MODEL_FILE: digest.version, **external}
