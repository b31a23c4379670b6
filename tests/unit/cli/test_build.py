"""``inferd build`` (``inferd.cli.build``) on the fakes: build config files, build then
reuse, calibration data, missing TensorRT, failures and the site shims."""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.cli import build as tensorrt_cli
from inferd.digest import sha256_file
from inferd.engines import calibration as calib
from inferd.engines import read_host_tuple
from inferd.engines.build_config import load_build_config
from inferd.engines.manifest import Manifest
from inferd.runtime import tensorrt as trt_runtime
from inferd.types import (
    BuildConfig,
    PrecisionMode,
)
from tests.fakes import gpu_site
from tests.tensorrt_bench import (
    SCALE_PROFILE,
    Bench,
    W,
    run_pipeline,
    write_custom_op_model,
)

# -- inferd build ------------------------------------------------------------------------------


def _build_config_file(tmp_path: Path, document: Any) -> Path:
    path = tmp_path / "build.json"
    path.write_text(json.dumps(document))
    return path


def test_build_config_json(tmp_path: Path) -> None:
    config = load_build_config(
        _build_config_file(
            tmp_path,
            {
                "precision": "fp16",
                "workspace_bytes": 1 << 28,
                "optimization_level": 4,
                "profiles": [
                    {
                        "input_name": "x",
                        "min_shape": [1, 64],
                        "opt_shape": [4, 64],
                        "max_shape": [8, 64],
                    }
                ],
            },
        )
    )
    assert config == BuildConfig(PrecisionMode.FP16, 1 << 28, 4, (SCALE_PROFILE,))
    assert load_build_config(_build_config_file(tmp_path, {})) == BuildConfig()


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ({"precison": "fp16"}, "unknown key"),
        ({"precision": "fp64"}, "not one of"),
        ({"workspace_bytes": True}, "must be an integer"),
        ({"optimization_level": 9}, "0..5"),
        ({"profiles": [{"input_name": "x"}]}, "exactly the keys"),
        ([], "JSON object"),
    ],
)
def test_bad_build_configs_are_usage_errors(
    bench: Bench, demo_model: Path, tmp_path: Path, document: Any, fragment: str
) -> None:
    err = io.StringIO()
    code = tensorrt_cli.run(demo_model, _build_config_file(tmp_path, document), err=err)
    assert code == tensorrt_cli.EXIT_USAGE and fragment in err.getvalue()
    assert bench.gpu.trt.builds == 0


def off_jetson(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Runtimes made by ``inferd build`` read no /etc/nv_tegra_release (platform none)."""
    probe = functools.partial(read_host_tuple, tegra_release=tmp_path / "absent")
    monkeypatch.setattr(trt_runtime, "read_host_tuple", probe)


def test_inferd_build_builds_then_reuses_and_records_the_manifest(
    bench: Bench, demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    off_jetson(monkeypatch, tmp_path)
    config = _build_config_file(tmp_path, {"precision": "fp16"})
    manifest = tmp_path / "deploy" / "manifest.json"
    out = io.StringIO()
    code = tensorrt_cli.run(
        demo_model, config, engine_dir=bench.engine_dir, manifest=manifest, out=out
    )
    assert code == 0, out.getvalue()
    text = out.getvalue()
    assert text.startswith("built ") and "precision flags FP16" in text
    assert "timing cache cold" in text and f"recorded in {manifest}" in text
    engine = next(bench.engine_dir.glob("demo_*_fp16_*.engine"))
    assert Manifest.load(manifest).lookup(engine) == sha256_file(engine)

    out = io.StringIO()
    code = tensorrt_cli.run(
        demo_model, config, engine_dir=bench.engine_dir, model_name="x", as_json=True, out=out
    )
    report = json.loads(out.getvalue())
    assert code == 0 and report["status"] == "reused" and report["engine"] == str(engine)
    assert report["sha256"] == sha256_file(engine) and bench.gpu.trt.builds == 1
    # the build detaches the context it built in (1) and validation's smoke
    # inference the one it ran in (1); finding the engine again needs none
    cuda = bench.gpu.cuda
    assert cuda.contexts_detached == 2 == cuda.contexts_created


def test_inferd_build_with_calibration_data_is_an_observed_build(
    bench: Bench,
    scale_model: Path,
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--calibration-data`` (INT8) runs through ``run_build`` like any other build:
    events, a summary next to the engine, and the trusted calibration cache."""
    off_jetson(monkeypatch, tmp_path)
    profile = {"input_name": "x", "min_shape": [1, W], "opt_shape": [4, W], "max_shape": [8, W]}
    config = _build_config_file(tmp_path, {"precision": "int8", "profiles": [profile]})
    events = tmp_path / "events.jsonl"
    out, err = io.StringIO(), io.StringIO()
    code = tensorrt_cli.run(
        scale_model,
        config,
        engine_dir=bench.engine_dir,
        calibration_data=dataset,
        json_log=events,
        as_json=True,
        out=out,
        err=err,
    )
    assert code == 0, err.getvalue()
    report = json.loads(out.getvalue().splitlines()[-1])
    build = report["build"]
    assert report["status"] == "built" and build["calibration"] == "calibrated"
    assert Path(build["summary"]).is_file() and build["outcome"] == "completed"
    types = {json.loads(line)["type"] for line in events.read_text().splitlines()}
    assert {"phase_start", "phase_finish", "completed"} <= types
    start = "start     Building engine (2 steps)  (timing cache at start: cold)"
    assert start in err.getvalue().splitlines()
    cache = calib.calibration_cache_path(Path(report["engine"]))
    assert calib.dataset_sidecar_path(cache).read_text().strip() == calib.dataset_sha256(dataset)
    assert bench.gpu.trt.calibration_batches == 3

    out = io.StringIO()
    code = tensorrt_cli.run(
        scale_model,
        config,
        engine_dir=bench.engine_dir,
        calibration_data=dataset,
        force=True,
        out=out,
        err=io.StringIO(),
    )
    assert code == 0 and "calibration reused" in out.getvalue()
    assert bench.gpu.trt.calibration_batches == 3


def _two_input_model(path: Path) -> Path:
    """``y = x + z``, both float32 ``[N, W]``."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "z"], ["y"])],
        "pair",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", W]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", W]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", W])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


_GOOD = np.zeros((4, W), np.float32)
_BAD_BATCHES = {
    "short": (
        {"x": np.zeros((2, W), np.float32), "z": _GOOD},
        f"input 'x' is float32 [2, {W}], the network expects float32 [4, {W}] (the "
        "calibration profile's opt shape)",
    ),
    "dtype": (
        {"x": np.zeros((4, W), np.float64), "z": _GOOD},
        f"input 'x' is float64 [4, {W}], the network expects float32 [4, {W}] (the "
        "calibration profile's opt shape)",
    ),
    "missing": ({"x": _GOOD}, "lacks input(s) ['z'] (the network's inputs are ['x', 'z'])"),
    "extra": (
        {"x": _GOOD, "z": _GOOD, "label": np.zeros(4, np.int64)},
        "has array(s) ['label'] that are not network inputs (the network's inputs are ['x', 'z'])",
    ),
}


@pytest.mark.parametrize("case", sorted(_BAD_BATCHES))
def test_inferd_build_checks_every_calibration_batch_before_the_build_starts(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A batch TensorRT would read past (short), misread (dtype) or that names other
    inputs fails ``inferd build`` before any builder or GPU work, naming the file, the
    input, what the network expects and what the file holds; nothing is left behind."""
    off_jetson(monkeypatch, tmp_path)
    model = _two_input_model(tmp_path / "pair.onnx")
    profiles = [
        {"input_name": name, "min_shape": [1, W], "opt_shape": [4, W], "max_shape": [8, W]}
        for name in ("x", "z")
    ]
    config = _build_config_file(tmp_path, {"precision": "int8", "profiles": profiles})
    data = tmp_path / "calibration"
    data.mkdir()
    np.savez(data / "batch0.npz", x=_GOOD, z=_GOOD)
    arrays, problem = _BAD_BATCHES[case]
    bad = data / "batch1.npz"
    np.savez(bad, **arrays)
    out, err = io.StringIO(), io.StringIO()
    code = tensorrt_cli.run(
        model, config, engine_dir=bench.engine_dir, calibration_data=data, out=out, err=err
    )
    assert code == tensorrt_cli.EXIT_FAILED
    assert err.getvalue() == f"inferd build: build failed: calibration batch {bad}: {problem}\n"
    assert "Builder" not in bench.gpu.trt.calls and "mem_alloc" not in bench.gpu.cuda.calls
    assert not bench.engine_dir.exists() or not any(bench.engine_dir.iterdir())


def test_inferd_build_without_tensorrt_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, demo_model: Path, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    err = io.StringIO()
    code = tensorrt_cli.run(
        demo_model, _build_config_file(tmp_path, {}), engine_dir=tmp_path, err=err
    )
    assert code == tensorrt_cli.EXIT_USAGE
    assert "cannot build here" in err.getvalue() and "tensorrt" in err.getvalue()


def test_inferd_build_reports_a_failed_build(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    off_jetson(monkeypatch, tmp_path)
    custom = write_custom_op_model(tmp_path / "custom.onnx")
    err = io.StringIO()
    code = tensorrt_cli.run(
        custom, _build_config_file(tmp_path, {}), engine_dir=bench.engine_dir, err=err
    )
    assert code == tensorrt_cli.EXIT_FAILED and "UNSUPPORTED_NODE" in err.getvalue()


def test_the_site_shims_serve_a_subprocess_and_its_engines_load_here(
    bench: Bench, demo_model: Path
) -> None:
    """``gpu_site.prebuild_engine`` runs ``inferd build`` in a subprocess whose
    ``import tensorrt`` / ``pycuda.driver`` load the fakes (tests/fakes/site)."""
    report = gpu_site.prebuild_engine(demo_model, bench.engine_dir, precision="fp32")
    engine = Path(report["engine"])
    assert report["status"] == "built" and engine.parent == bench.engine_dir
    assert Manifest.load(bench.engine_dir / "manifest.json").lookup(engine) == report["sha256"]
    runtime = bench.runtime()
    entry = run_pipeline(bench, demo_model, BuildConfig()).entry
    assert entry.artifact_path == engine and bench.gpu.trt.builds == 0
    handle = runtime.deserialize_engine(entry)
    assert handle.runtime_label == "tensorrt"
    env = gpu_site.fake_gpu_env({"PATH": os.environ.get("PATH", "")})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(gpu_site.SITE_DIR)


# -- config and fakes ---------------------------------------------------------------------------


def _daemon_config(tmp_path: Path, model: Path, bench: Bench) -> Path:
    path = tmp_path / "inferd.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[runtime]\nengine_dir = "{bench.engine_dir}"\n'
        f'[[models]]\nname = "scale"\npath = "{model}"\nruntime = "tensorrt"\n'
        f'[[models.profiles]]\ninput_name = "x"\nmin_shape = [1, {W}]\n'
        f"opt_shape = [4, {W}]\nmax_shape = [8, {W}]\n"
    )
    return path


def test_inferd_build_of_a_configured_model_takes_its_profiles_from_the_daemon_config(
    bench: Bench, scale_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine the daemon looks for is named after the model's build config,
    profiles included: ``inferd build`` builds exactly that one."""
    off_jetson(monkeypatch, tmp_path)
    daemon_config = _daemon_config(tmp_path, scale_model, bench)
    out, err = io.StringIO(), io.StringIO()
    code = tensorrt_cli.run(
        scale_model,
        _build_config_file(tmp_path, {}),
        daemon_config=daemon_config,
        as_json=True,
        out=out,
        err=err,
    )
    assert code == 0, err.getvalue()
    report = json.loads(out.getvalue().splitlines()[-1])
    from inferd import config as config_module
    from inferd.engines.locate import locate_engine

    (model,) = config_module.load(daemon_config).models
    host = read_host_tuple(
        precision=PrecisionMode.FP32, device_index=0, tegra_release=tmp_path / "absent"
    )
    expected = locate_engine(
        scale_model, model.build_config(), engine_dir=bench.engine_dir, host=host
    )
    assert expected.status == "reused" and report["engine"] == str(expected.entry.artifact_path)


def test_inferd_build_refuses_profiles_other_than_the_daemon_configs(
    bench: Bench, scale_model: Path, tmp_path: Path
) -> None:
    other = {"input_name": "x", "min_shape": [1, W], "opt_shape": [1, W], "max_shape": [1, W]}
    err = io.StringIO()
    code = tensorrt_cli.run(
        scale_model,
        _build_config_file(tmp_path, {"profiles": [other]}),
        daemon_config=_daemon_config(tmp_path, scale_model, bench),
        err=err,
    )
    assert code == tensorrt_cli.EXIT_USAGE
    assert "profiles differ from models['scale'].profiles" in err.getvalue()
    assert bench.gpu.trt.builds == 0


def test_without_a_build_config_the_model_is_built_as_the_daemon_config_serves_it(
    bench: Bench, scale_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--config`` is the daemon's TOML in every command; with it alone, ``inferd
    build`` builds the engine the daemon would look for (its precision, its profiles)."""
    off_jetson(monkeypatch, tmp_path)
    daemon_config = _daemon_config(tmp_path, scale_model, bench)
    parser = argparse.ArgumentParser()
    tensorrt_cli.add_arguments(parser)
    args = parser.parse_args([str(scale_model), "--config", str(daemon_config), "--json"])
    assert (args.daemon_config, args.build_config) == (daemon_config, None)
    out, err = io.StringIO(), io.StringIO()
    code = tensorrt_cli.run(
        args.onnx, daemon_config=args.daemon_config, as_json=True, out=out, err=err
    )
    assert code == 0, err.getvalue()
    from inferd import config as config_module
    from inferd.engines.locate import locate_engine

    (model,) = config_module.load(daemon_config).models
    host = read_host_tuple(
        precision=PrecisionMode.FP32, device_index=0, tegra_release=tmp_path / "absent"
    )
    expected = locate_engine(
        scale_model, model.build_config(), engine_dir=bench.engine_dir, host=host
    )
    report = json.loads(out.getvalue().splitlines()[-1])
    assert report["engine"] == str(expected.entry.artifact_path)


def test_the_build_config_schema_and_its_example_match_the_parser() -> None:
    """The documented example is valid for both the JSON Schema and the one parser,
    and the schema names exactly the keys the parser knows."""
    import jsonschema

    from inferd.engines.build_config import BUILD_CONFIG_KEYS, PROFILE_KEYS, load_build_config
    from tests.conftest import REPO

    schema = json.loads((REPO / "schemas/build/config.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    example_path = REPO / "schemas/build/config.example.json"
    jsonschema.validate(json.loads(example_path.read_text()), schema)
    parsed = load_build_config(example_path)
    assert (parsed.precision.value, parsed.profiles[0].opt_shape) == ("fp16", (4, 3, 224, 224))
    assert set(schema["properties"]) == BUILD_CONFIG_KEYS
    assert set(schema["properties"]["profiles"]["items"]["properties"]) == PROFILE_KEYS
