"""A model's digest covers its external data files (``inferd.digest``,
``inferd.external_data``): new weights beside the same ``.onnx`` are another model, a
model without external data keeps its file's SHA-256, and a location that could name
a file outside the model's folder is refused.  Asked through ``sha256_remembered``,
what ``locate_engine`` and the ``onnx_trt_ep`` runtime name and key a model by."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from inferd import digest
from inferd.config import RuntimeConfig
from inferd.digest import remembered_sha256, sha256_remembered
from inferd.errors import EngineBuildError
from inferd.external_data import ExternalDataEscapeError, open_external_file
from inferd.runtime.onnx_trt_ep import OnnxTrtEpRuntime
from inferd.types import BuildConfig, EngineCacheEntry, ThermalState
from tests.tensorrt_bench import W
from tests.unit.engine_build.test_build_model_identity import write_affine


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def new_weights(model: Path, bias: float) -> None:
    """Another model's weights written over ``model``'s external data file, in place
    (same size, same offsets: the ``.onnx`` is byte for byte the same)."""
    other = write_affine(model.parent / "incoming" / model.name, bias, external=True)
    assert other.read_bytes() == model.read_bytes()
    (model.parent / f"{model.name}.data").write_bytes(
        (other.parent / f"{model.name}.data").read_bytes()
    )


def relocate(model: Path, location: str) -> None:
    """Point every external tensor of ``model`` at ``location``."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    model.write_bytes(proto.SerializeToString())


def test_a_model_without_external_data_keeps_its_files_sha256(tmp_path: Path) -> None:
    """What engines built before were named by: existing engines stay valid."""
    import onnx

    model = write_affine(tmp_path / "m.onnx", 1.0)
    assert sha256_remembered(model) == sha256(model)
    # a model that mentions "location" (parsed to look) but keeps its data inline
    proto = onnx.load(str(model))
    proto.graph.node[0].name = "location"
    mentions = tmp_path / "mentions.onnx"
    onnx.save(proto, str(mentions))
    assert b"location" in mentions.read_bytes()
    assert sha256_remembered(mentions) == sha256(mentions)


def test_new_weights_beside_the_same_onnx_are_another_model(tmp_path: Path) -> None:
    model = write_affine(tmp_path / "models" / "m.onnx", 1.0, external=True)
    data = model.parent / "m.onnx.data"
    before = sha256_remembered(model)
    # the shell recipe OPERATIONS.md gives an operator
    recipe = 'cd "$1" && { sha256sum - < m.onnx; sha256sum m.onnx.data; } | sha256sum'
    shell = subprocess.run(
        ["sh", "-c", recipe, "sh", str(model.parent)], capture_output=True, text=True, check=True
    )
    assert before == shell.stdout.split()[0] != sha256(model)
    assert remembered_sha256(model) == before

    stat = data.stat()
    new_weights(model, 1.05)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime put back
    assert remembered_sha256(model) is None  # never a digest of other weights
    assert sha256_remembered(model) not in (before, sha256(model))


@pytest.mark.parametrize("chunk", [1, 3, 8, 100])
def test_a_location_across_two_reads_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """A big model is hashed in chunks: its external data is found wherever they end."""
    model = write_affine(tmp_path / "m.onnx", 1.0, external=True)
    whole = sha256_remembered(model)
    monkeypatch.setattr(digest, "_CHUNK_BYTES", chunk)
    assert sha256_remembered(model) == whole != sha256(model)


def _absolute(model: Path) -> str:
    return str(model.parent / "m.onnx.data")


def _parent(model: Path) -> str:
    shutil.copy(model.parent / "m.onnx.data", model.parent.parent / "m.onnx.data")
    return "../m.onnx.data"


def _inner_parent(model: Path) -> str:
    (model.parent / "sub").mkdir()
    return "sub/../../m.onnx.data"


def _file_symlink(model: Path) -> str:
    (model.parent / "link.data").symlink_to(model.parent / "m.onnx.data")
    return "link.data"


def _folder_symlink(model: Path) -> str:
    (model.parent / "weights").symlink_to(model.parent)
    return "weights/m.onnx.data"


@pytest.mark.parametrize(
    ("escape", "why"),
    [
        (_absolute, "is an absolute path"),
        (_parent, "has a '..' component"),
        (_inner_parent, "has a '..' component"),
        (_file_symlink, "goes through a symbolic link (link.data)"),
        (_folder_symlink, "goes through a symbolic link (weights)"),
    ],
    ids=["absolute", "parent", "inner-parent", "file-symlink", "folder-symlink"],
)
def test_a_location_that_may_name_a_file_outside_the_models_folder_is_refused(
    tmp_path: Path, escape: Callable[[Path], str], why: str
) -> None:
    """Each names a readable file.  ONNX Runtime 1.32 refuses an absolute path, a
    ``..`` and a link out of the folder itself, but not every version inferd supports
    (1.17 on) does, and TensorRT's parser refuses only ``..``; both follow a link."""
    import onnxruntime

    model = write_affine(tmp_path / "models" / "m.onnx", 1.0, external=True)
    relocate(model, escape(model))
    with pytest.raises(ExternalDataEscapeError, match="refused") as refused:
        sha256_remembered(model)
    assert why in str(refused.value)
    if why.startswith("goes through"):  # ONNX Runtime 1.32 itself follows the link
        session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        (y,) = session.run(None, {"x": np.ones((2, W), np.float32)})
        assert np.allclose(y, 3.0)


def test_a_model_whose_external_data_file_is_missing_or_not_a_file_cannot_be_hashed(
    tmp_path: Path,
) -> None:
    model = write_affine(tmp_path / "m.onnx", 1.0, external=True)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(FileNotFoundError):
        sha256_remembered(model)
    (tmp_path / "m.onnx.data").mkdir()
    with pytest.raises(OSError, match="not a regular file"):
        open_external_file(str(tmp_path), "m.onnx.data")


def test_onnx_runtime_serving_keys_a_model_by_its_weights_and_refuses_an_escape(
    tmp_path: Path,
) -> None:
    """``onnx_trt_ep`` names its TensorRT EP cache and gates a staged engine by the
    digest ``compile_engine`` takes: new weights are another model there too."""
    runtime = OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=lambda _alert: None,
        thermal=ThermalState.unavailable,
    )
    model = write_affine(tmp_path / "models" / "m.onnx", 1.0, external=True)
    before = runtime.compile_engine(model, BuildConfig()).model_sha256
    new_weights(model, 1.05)
    assert runtime.compile_engine(model, BuildConfig()).model_sha256 != before
    relocate(model, "../m.onnx.data")
    with pytest.raises(EngineBuildError, match=r"has a '\.\.' component: refused"):
        runtime.compile_engine(model, BuildConfig())


def _runtime(tmp_path: Path) -> OnnxTrtEpRuntime:
    return OnnxTrtEpRuntime(
        RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"),
        alert=lambda _alert: None,
        thermal=ThermalState.unavailable,
    )


def test_weights_changed_while_onnx_runtime_loads_the_model_refuse_the_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime reads external data by path after the load hashed it: weights
    written over in place while the session is made load nothing."""
    from inferd.errors import EngineDeserializeError
    from inferd.runtime import onnx_trt_ep

    runtime = _runtime(tmp_path)
    model = write_affine(tmp_path / "models" / "m.onnx", 1.0, external=True)
    entry = runtime.compile_engine(model, BuildConfig())
    real_create = onnx_trt_ep.create_session

    def swapped_then_created(*args: object, **kwargs: object) -> object:
        new_weights(model, 1.05)
        return real_create(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(onnx_trt_ep, "create_session", swapped_then_created)
    with pytest.raises(EngineDeserializeError, match="changed while ONNX Runtime loaded it"):
        runtime.deserialize_engine(entry)


def test_a_model_touched_but_not_changed_since_it_was_hashed_still_loads(
    tmp_path: Path,
) -> None:
    """A new mtime alone (a copy that kept the bytes) is hashed again, not refused."""
    runtime = _runtime(tmp_path)
    model = write_affine(tmp_path / "models" / "m.onnx", 1.0, external=True)
    entry = runtime.compile_engine(model, BuildConfig())
    os.utime(model.parent / "m.onnx.data", ns=(1, 1))
    assert remembered_sha256(model) is None
    handle = runtime.deserialize_engine(entry)
    assert handle.model_sha256 == entry.model_sha256
    runtime.release_engine(handle)


def _swapped_while_the_session_is_made(
    monkeypatch: pytest.MonkeyPatch, target: Path, other: Path
) -> None:
    """Every ONNX Runtime session is made while ``other`` is renamed over ``target``;
    the original is renamed back before it returns (A to B to A: the same inode and
    bytes as hashed, so a new hash of ``target`` finds A again)."""
    import onnxruntime

    real = onnxruntime.InferenceSession
    aside = target.with_name(f"{target.name}.aside")

    def swapping(*args: object, **kwargs: object) -> object:
        os.rename(target, aside)
        os.rename(other, target)
        try:
            return real(*args, **kwargs)
        finally:
            os.rename(target, other)
            os.rename(aside, target)

    monkeypatch.setattr(onnxruntime, "InferenceSession", swapping)


def _served(runtime: OnnxTrtEpRuntime, entry: EngineCacheEntry) -> float:
    """What the loaded model computes for x = 1: 3.0 for A (bias 1.0), 3.05 for B."""
    handle = runtime.deserialize_engine(entry)
    try:
        (y,) = runtime.infer(handle, {"x": np.ones((2, W), np.float32)}).values()
    finally:
        runtime.release_engine(handle)
    assert np.allclose(y, y.flat[0])
    return float(y.flat[0])


def test_a_model_file_swapped_and_back_while_the_session_is_made_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session is made from the very bytes hashed for the load: B renamed over
    the ``.onnx`` and A renamed back while ONNX Runtime makes it serves A."""
    runtime = _runtime(tmp_path)
    model = write_affine(tmp_path / "models" / "m.onnx", 1.0)
    other = write_affine(tmp_path / "incoming" / "m.onnx", 1.05)
    entry = runtime.compile_engine(model, BuildConfig())
    _swapped_while_the_session_is_made(monkeypatch, model, other)
    assert _served(runtime, entry) == pytest.approx(3.0)
    assert sha256(model) == entry.model_sha256


def test_an_external_data_file_swapped_and_back_while_the_session_is_made_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime reads external data by path: a data file replaced by rename and
    put back while it reads is no longer the file hashed (its ctime moved), and the
    load is refused although the model's digest is A's again."""
    from inferd.errors import EngineDeserializeError

    runtime = _runtime(tmp_path)
    model = write_affine(tmp_path / "models" / "m.onnx", 1.0, external=True)
    write_affine(tmp_path / "incoming" / "m.onnx", 1.05, external=True)
    entry = runtime.compile_engine(model, BuildConfig())
    data = model.parent / "m.onnx.data"
    _swapped_while_the_session_is_made(monkeypatch, data, tmp_path / "incoming" / "m.onnx.data")
    with pytest.raises(EngineDeserializeError, match="changed while ONNX Runtime loaded it"):
        _served(runtime, entry)
    assert sha256_remembered(model) == entry.model_sha256  # A again: a new hash cannot see it
    monkeypatch.undo()
    assert _served(runtime, entry) == pytest.approx(3.0)  # loaded again: A


@pytest.mark.parametrize(
    ("swapped", "named"),
    [("m.onnx", "the model file"), ("m.onnx.data", "its external data file m.onnx.data")],
)
def test_before_onnx_runtime_1_21_a_model_with_external_data_loads_by_path_and_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: str, named: str
) -> None:
    """Given bytes, ONNX Runtime before 1.21 finds no external data (it has no folder
    option): such a model loads from its path, and every file, the ``.onnx`` too, must
    be the very file hashed once the session exists."""
    import onnxruntime

    from inferd.errors import EngineDeserializeError

    monkeypatch.setattr(onnxruntime, "__version__", "1.20.1")
    runtime = _runtime(tmp_path)
    model = write_affine(tmp_path / "models" / "m.onnx", 1.0, external=True)
    write_affine(tmp_path / "incoming" / "m.onnx", 1.05, external=True)
    entry = runtime.compile_engine(model, BuildConfig())
    assert _served(runtime, entry) == pytest.approx(3.0)
    target = model.parent / swapped
    _swapped_while_the_session_is_made(monkeypatch, target, tmp_path / "incoming" / swapped)
    with pytest.raises(EngineDeserializeError, match=f"{named} was written or replaced"):
        _served(runtime, entry)


def test_a_model_changed_after_it_was_hashed_for_the_load_loads_nothing(tmp_path: Path) -> None:
    """The bytes read for the session are checked against the digest ``compile_engine``
    took (the one the TensorRT EP's cache is named by)."""
    from inferd.errors import EngineDeserializeError

    runtime = _runtime(tmp_path)
    model = write_affine(tmp_path / "models" / "m.onnx", 1.0, external=True)
    entry = runtime.compile_engine(model, BuildConfig())
    new_weights(model, 1.05)
    with pytest.raises(EngineDeserializeError, match="changed since it was hashed for this load"):
        runtime.deserialize_engine(entry)


@pytest.mark.parametrize(
    ("external", "tensorrt_ep", "by_path"),
    [(True, True, True), (True, False, False), (False, True, False), (False, False, False)],
)
def test_a_session_asking_for_the_tensorrt_ep_gets_a_model_with_external_data_by_path(
    tmp_path: Path, external: bool, tensorrt_ep: bool, by_path: bool
) -> None:
    """That the TensorRT EP finds the external weights of a model given as bytes is
    not confirmed on a GPU: such a session is made from the path, checked after like
    one before ONNX Runtime 1.21; every other is made from the bytes hashed."""
    import onnxruntime

    from inferd.runtime.ort_model_source import HashedModel

    runtime = _runtime(tmp_path)
    model = write_affine(tmp_path / "models" / "m.onnx", 1.0, external=external)
    entry = runtime.compile_engine(model, BuildConfig())
    source = HashedModel(entry).session_model(onnxruntime, tensorrt_ep=tensorrt_ep).source
    assert source == (model if by_path else model.read_bytes())
