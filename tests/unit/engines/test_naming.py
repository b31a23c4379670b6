"""The engine naming schema (``inferd.engines.naming``): format/parse round trips,
refusals that say why, SKU and label sanitising, the build-config hash."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.engines import (
    EngineName,
    build_config_hash,
    engine_name_for,
    format_engine_name,
    parse_engine_name,
    sanitize_label,
    sanitize_sku,
)
from inferd.errors import EngineSchemaMismatchError
from inferd.types import BuildConfig, HostTuple, OptimizationProfile, PrecisionMode
from tests.conftest import examples
from tests.unit.engines.conftest import HOST, MODEL_SHA, VALID, name_for

# The strings of the regexes the schema's fields follow, drawn piece by piece: the same
# strings as ``st.from_regex`` gives, at a third of its cost per example.
_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
#: ``[a-z0-9]{1,6}(-[a-z0-9]{1,6}){0,3}``
_WORDS = st.lists(st.text(_ALNUM, min_size=1, max_size=6), min_size=1, max_size=4).map("-".join)
#: ``0|[1-9][0-9]{0,3}``: a number without leading zeros
_INT4 = st.integers(0, 9999).map(str)

hosts = st.builds(
    HostTuple,
    compute_capability=st.tuples(st.integers(0, 99), st.integers(0, 99)),
    gpu_sku=_WORDS,
    platform=st.one_of(  # r{INT4}(.{INT4}){0,3}
        st.just("none"), st.lists(_INT4, min_size=1, max_size=4).map(lambda p: "r" + ".".join(p))
    ),
    tensorrt_version=st.builds(  # {INT4}(.[0-9a-z]{1,12}){2,4}
        lambda major, rest: ".".join([major, *rest]),
        _INT4,
        st.lists(st.text(_ALNUM, min_size=1, max_size=12), min_size=2, max_size=4),
    ),
    precision=st.sampled_from(PrecisionMode),
)
engine_names = st.builds(
    EngineName,
    label=_WORDS,
    model_sha256_prefix=st.text("0123456789abcdef", min_size=16, max_size=16),
    host=hosts,
    build_config_hash=st.text("0123456789abcdef", min_size=12, max_size=12),
)


@given(engine_names)
@settings(max_examples=examples(300))
def test_format_and_parse_round_trip_exactly(name: EngineName) -> None:
    text = format_engine_name(name)
    assert parse_engine_name(text) == name
    assert format_engine_name(parse_engine_name(text)) == text
    assert len(text.encode()) <= 255
    assert set(text) <= set("abcdefghijklmnopqrstuvwxyz0123456789._-")


@given(
    engine_names,
    st.lists(
        st.tuples(
            st.sampled_from(["replace", "insert", "delete"]),
            st.integers(0, 300),
            st.sampled_from(list("abcmrt0179._-ABZ /")),
        ),
        min_size=1,
        max_size=3,
    ),
)
@settings(max_examples=examples(500))
def test_any_string_either_parses_to_itself_or_refuses_cleanly(
    name: EngineName, edits: list[tuple[str, int, str]]
) -> None:
    text = format_engine_name(name)
    for kind, position, char in edits:
        at = position % (len(text) + 1)
        if kind == "replace" and at < len(text):
            text = text[:at] + char + text[at + 1 :]
        elif kind == "insert":
            text = text[:at] + char + text[at:]
        elif at < len(text):
            text = text[:at] + text[at + 1 :]
    try:
        parsed = parse_engine_name(text)
    except EngineSchemaMismatchError as exc:
        assert "naming schema" in str(exc) or "file name" in str(exc)
    else:
        assert format_engine_name(parsed) == text


@given(engine_names)
@settings(max_examples=examples(200))
def test_leading_zeros_never_alias_another_name(name: EngineName) -> None:
    text = format_engine_name(name)
    starts = [
        i for i, c in enumerate(text) if c.isdigit() and (i == 0 or not text[i - 1].isdigit())
    ]
    for at in starts:
        padded = text[:at] + "0" + text[at:]
        try:
            parsed = parse_engine_name(padded)
        except EngineSchemaMismatchError:
            continue
        assert format_engine_name(parsed) == padded


def test_the_documented_example_name() -> None:
    name = EngineName(
        label="demo",
        model_sha256_prefix="3f2a9b1c4d5e6f70",
        host=HOST,
        build_config_hash="1a2b3c4d5e6f",
    )
    text = "demo_m3f2a9b1c4d5e6f70_cc8.7-orin_r36.4.0_trt10.3.0.30_fp16_b1a2b3c4d5e6f.engine"
    assert format_engine_name(name) == text
    assert parse_engine_name(text) == name


def test_compute_capability_10_0_is_not_1_00() -> None:
    host = HostTuple((10, 0), "thor", "r38.2.0", "10.13.0.2", PrecisionMode.FP32)
    text = name_for(host)
    assert "_cc10.0-thor_" in text
    assert parse_engine_name(text).host.compute_capability == (10, 0)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (VALID.removesuffix(".engine") + ".plan", "does not end in '.engine'"),
        (VALID.replace("_r36.4.0", ""), "6 '_'-separated field(s), the schema has 7"),
        ("demo_x" + VALID[len("demo") :], "8 '_'-separated field(s)"),
        (VALID.replace("_cc8.7-", "_cc08.7-"), "field 3 (gpu) 'cc08.7-orin'"),
        (VALID.replace("_cc8.7-orin", "_cc8.7"), "field 3 (gpu)"),
        (VALID.replace("-orin_", "-Orin_"), "GPU SKU 'Orin'"),
        (VALID.replace("_m", "_M", 1), "field 2 (model)"),
        (VALID.replace("_fp16_", "_FP16_"), "field 6 (precision) 'FP16' is not one of"),
        (VALID.replace("_fp16_", "_bf16_"), "field 6 (precision)"),
        (VALID.replace("_r36.4.0_", "_R36.4.0_"), "platform release 'R36.4.0'"),
        (VALID.replace("_r36.4.0_", "_jetpack6_"), "platform release 'jetpack6'"),
        (VALID.replace("_trt10.3.0.30_", "_trt10.3_"), "TensorRT version '10.3' is not a full"),
        (VALID.replace("_trt10.3.0.30_", "_10.3.0.30_"), "field 5 (tensorrt)"),
        (VALID.replace("demo_", "-demo_", 1), "field 1 (label)"),
        (VALID[: VALID.index("_b") + 2] + "xyz.engine", "field 7 (build config)"),
        ("engines/" + VALID, "it is a path"),
        ("a" * 250 + VALID, "longer than 255 bytes"),
        ("", "does not end in"),
    ],
)
def test_names_that_do_not_parse_say_why(text: str, fragment: str) -> None:
    with pytest.raises(EngineSchemaMismatchError) as caught:
        parse_engine_name(text)
    assert fragment in str(caught.value)
    assert caught.value.expected == {} and caught.value.got == {}


@pytest.mark.parametrize(
    ("raw", "sku"),
    [
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
        (b"NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("Orin (nvgpu)", "orin-nvgpu"),
        ("Orin", "orin"),
        ("NVIDIA Jetson AGX Thor_Developer Kit", "jetson-agx-thor-developer-kit"),
        ("  ", "unknown"),
        ("X" * 60, "x" * 40),
    ],
)
def test_sanitize_sku(raw: str | bytes, sku: str) -> None:
    assert sanitize_sku(raw) == sku
    HostTuple((8, 7), sku, "none", "10.3.0.30", PrecisionMode.FP32)  # always valid


def test_sanitize_label() -> None:
    assert sanitize_label("YOLOv8_nav-Net.onnx") == "yolov8-nav-net-onnx"
    assert sanitize_label("__") == "model"
    assert len(sanitize_label("a" * 100)) == 48


def test_build_config_hash_is_stable_and_sensitive() -> None:
    base = BuildConfig()
    # Pinned: changing the canonical form silently would orphan every built engine.
    assert build_config_hash(base) == build_config_hash(BuildConfig())
    profile_a = OptimizationProfile("x", (1, 3), (4, 3), (8, 3))
    canonical = {
        "schema": "inferd.build_config/1",
        "config": {
            "precision": "int8",
            "workspace_bytes": 1 << 30,
            "optimization_level": 3,
            "profiles": [
                {"input_name": "x", "min_shape": [1, 3], "opt_shape": [4, 3], "max_shape": [8, 3]}
            ],
        },
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    config = BuildConfig(precision=PrecisionMode.INT8, profiles=(profile_a,))
    assert build_config_hash(config) == hashlib.sha256(text.encode()).hexdigest()[:12]
    assert build_config_hash(base) == "ebc849754489"
    profile_b = OptimizationProfile("y", (1,), (2,), (4,))
    variants = [
        BuildConfig(precision=PrecisionMode.FP16),
        BuildConfig(workspace_bytes=2 << 30),
        BuildConfig(optimization_level=5),
        BuildConfig(profiles=(profile_a,)),
        BuildConfig(profiles=(profile_a, profile_b)),
        BuildConfig(profiles=(profile_b, profile_a)),
    ]
    hashes = {build_config_hash(config) for config in [base, *variants]}
    assert len(hashes) == len(variants) + 1


def test_engine_name_for_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="precision fp16 differs"):
        engine_name_for(label="m", model_sha256=MODEL_SHA, host=HOST, build_config=BuildConfig())
    with pytest.raises(ValueError, match="64-digit hex"):
        engine_name_for(
            label="m",
            model_sha256="abc",
            host=HOST,
            build_config=BuildConfig(precision=PrecisionMode.FP16),
        )
    name = parse_engine_name(name_for())
    assert name.matches_model(MODEL_SHA) and not name.matches_model("0" * 64)
