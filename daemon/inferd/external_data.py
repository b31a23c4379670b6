"""A model's external data files: which ones it names, and opening them safely.

An ONNX model may keep tensors outside its ``.onnx`` file: a tensor whose
``data_location`` is ``EXTERNAL`` names, under the ``location`` key of its
``external_data``, a file relative to the model's folder, which ONNX Runtime and
TensorRT's parser read by path when they load the model.  Those files are part of
what the model computes, so the model's digest covers them (``inferd.digest``).

A location is refused (``ExternalDataEscapeError``) when it could name a file
outside the model's folder: an absolute path, a ``..`` component, or a symbolic
link at any of its components.  TensorRT's parser refuses only ``..`` and follows a
link; ONNX Runtime 1.32 refuses all three when they leave the folder, but not
every version inferd supports (1.17 on) does.  The model's folder itself is the
operator's: it may be reached through a symlink, as the model file may (DESIGN.md
entry 54).

Listing the locations parses the model's protobuf (``onnx`` imported here, at the
point of use), without loading any external data.  Every location is stored
under the key ``location``, a protobuf string, whose bytes the model holds as they
are; so a model whose bytes do not contain them has no external data and is not
parsed: one with its weights inline (hundreds of MB) costs a byte search.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

#: The ``external_data`` key naming a tensor's file; its bytes are in any model that has one.
LOCATION_KEY = "location"
LOCATION_BYTES = LOCATION_KEY.encode("ascii")


class ExternalDataError(OSError):
    """A model's external data cannot be listed or read: the model does not parse, or
    an external tensor names no file.  An ``OSError``: the model cannot be read."""


class ExternalDataEscapeError(ExternalDataError):
    """An external data location that could name a file outside the model's folder:
    absolute, with a ``..`` component, or through a symbolic link."""


def model_directory(model: Path) -> str:
    """The folder a model's external data locations are relative to: the folder of
    its absolute path (not resolved: the path TensorRT's parser and ONNX Runtime get)."""
    return os.path.dirname(os.path.abspath(model))


def mentions_external_data(data: bytes) -> bool:
    """False when ``data`` (a model's bytes) cannot name any external data file."""
    return LOCATION_BYTES in data


def external_data_locations(data: bytes) -> tuple[str, ...]:
    """The files the model ``data`` keeps tensors in, each once, normalised
    (``./w.bin`` is ``w.bin``) and sorted; ``ExternalDataEscapeError`` for a location
    outside its folder, ``ExternalDataError`` when the model does not parse."""
    if not mentions_external_data(data):
        return ()
    from onnx import ModelProto, TensorProto

    model = ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError, or a recursion limit
        raise ExternalDataError(f"cannot parse it to find its external data files: {exc}") from None
    locations: set[str] = set()
    for tensor in _model_tensors(model):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue  # ONNX Runtime and TensorRT read no file for it
        named = [entry.value for entry in tensor.external_data if entry.key == LOCATION_KEY]
        if not named:
            raise ExternalDataError(f"its external tensor {tensor.name!r} names no file")
        locations.update(_checked(location) for location in named)
    return tuple(sorted(locations))


def open_external_file(directory: str, location: str) -> tuple[io.FileIO, os.stat_result]:
    """The external data file ``location`` (from ``external_data_locations``) of the
    model in ``directory``, opened for reading with its ``fstat``, no component
    followed through a symbolic link (``ExternalDataEscapeError``); ``OSError`` when
    it is missing or not a regular file."""
    parts = location.split("/")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for index, part in enumerate(parts):
        kind = os.O_NONBLOCK if index == len(parts) - 1 else os.O_DIRECTORY
        try:
            child = _open_below(fd, part, kind, location)
        finally:
            os.close(fd)
        fd = child
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "is not a regular file", os.path.join(directory, location))
        return io.FileIO(fd, "rb", closefd=True), info
    except BaseException:
        os.close(fd)
        raise


def _open_below(parent: int, name: str, flags: int, location: str) -> int:
    """``name`` in the folder ``parent``, never through a symbolic link."""
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags, dir_fd=parent)
    except OSError as exc:
        # ELOOP, or ENOTDIR when a folder was asked for: is it a symlink?
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(parent, name):
            raise ExternalDataEscapeError(
                f"its external data location {location!r} goes through a symbolic link "
                f"({name}): refused, since ONNX Runtime and TensorRT would read whatever it "
                "points to"
            ) from None
        raise


def _is_symlink(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _checked(location: str) -> str:
    if not location or "\0" in location or "\n" in location:
        raise ExternalDataError(f"its external data location {location!r} is not a file name")
    path = PurePosixPath(location)
    why = (
        "is an absolute path"
        if path.is_absolute()
        else "has a '..' component"
        if ".." in path.parts
        else None
    )
    if why is not None:
        raise ExternalDataEscapeError(
            f"its external data location {location!r} {why}: refused, since it may name a "
            "file outside the model's folder, which ONNX Runtime or TensorRT may read"
        )
    return str(path)


def _model_tensors(model: Any) -> Iterator[Any]:
    """Every tensor of the model that may hold data: initializers (sparse ones too)
    and node attributes, in subgraphs and functions as well."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        yield from _node_tensors(function.node)


def _graph_tensors(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    yield from _sparse_tensors(graph.sparse_initializer)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: Iterable[Any]) -> Iterator[Any]:
    for node in nodes:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("sparse_tensor"):
                yield from _sparse_tensors([attribute.sparse_tensor])
            yield from _sparse_tensors(attribute.sparse_tensors)
            if attribute.HasField("g"):
                yield from _graph_tensors(attribute.g)
            for graph in attribute.graphs:
                yield from _graph_tensors(graph)


def _sparse_tensors(sparse: Iterable[Any]) -> Iterator[Any]:
    for tensor in sparse:
        yield tensor.values
        yield tensor.indices
