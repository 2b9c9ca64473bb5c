"""Lane kinds, recipes, modes and variants; the exhaustive mapping; cache identities never collide."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify.contract import lanes
from qualify.contract.lanes import (
    DEFAULT_NATIVE_TEXT_LANE,
    LANES,
    LaneKind,
    LaneSpec,
    NativeVariant,
    ProducerMode,
    Recipe,
    check_speculative_draft,
    lane_spec,
    recipe_for,
    target_cache_identity,
)
from qualify.core.assets import CONTRACTS_DIR
from qualify.core.digests import sha256_bytes
from qualify.core.errors import Refused

CHECKPOINT = {"config.json": sha256_bytes(b"config"), "nvfp4/model.safetensors": sha256_bytes(b"w")}


def test_every_lane_kind_has_a_recipe() -> None:
    """Fails when a LaneKind is added without a recipe (assert_never raises at run time too)."""
    for kind in LaneKind:
        assert isinstance(recipe_for(kind), Recipe), kind
    assert recipe_for(LaneKind.NVFP4) is Recipe.NATIVE_TEXT
    assert recipe_for(LaneKind.KQUANT) is Recipe.KQUANT_TARGET_PLUS_DFLASH


def test_recipe_mapping_is_an_exhaustive_match() -> None:
    source = inspect.getsource(recipe_for)
    assert "match kind:" in source and "assert_never(kind)" in source
    for kind in LaneKind:
        assert f"case LaneKind.{kind.name}:" in source
    with pytest.raises(AssertionError):
        recipe_for("sglang")  # type: ignore[arg-type]


def test_every_recipe_has_rung_schema_and_logit_mode() -> None:
    assert {recipe.value: recipe.rung for recipe in Recipe} == {
        "native-text": 2,
        "kquant-target-plus-dflash": 3,
    }
    assert Recipe.NATIVE_TEXT.onboarding_schema == "trust-ladder.native-text-onboarding.v1"
    assert (
        Recipe.KQUANT_TARGET_PLUS_DFLASH.onboarding_schema
        == "trust-ladder.kquant-target-plus-dflash-onboarding.v1"
    )
    assert Recipe.NATIVE_TEXT.full_logits_mode == "bounded-drift"
    assert Recipe.KQUANT_TARGET_PLUS_DFLASH.full_logits_mode == "exact"


def test_enum_values_are_exactly_the_legal_ones() -> None:
    assert [mode.value for mode in ProducerMode] == ["exact", "native"]
    assert [variant.value for variant in NativeVariant] == ["splitk", "f16", "w4a4"]
    assert [kind.value for kind in LaneKind] == ["nvfp4", "kquant", "vllm", "transformers", "torch-llama"]
    with pytest.raises(ValueError):
        ProducerMode("fast")


def _resolved(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """``node``, or the ``$defs`` entry it references."""
    ref = node.get("$ref")
    return schema["$defs"][ref.split("/")[-1]] if isinstance(ref, str) else node


def test_identity_schema_enums_match_the_python_enums() -> None:
    """The committed schema (generated from the identity model) lists exactly the lane table's values."""
    schema = json.loads((CONTRACTS_DIR / "onboarding-identity.v1.schema.json").read_text())
    properties = schema["properties"]
    assert _resolved(schema, properties["lane_kind"])["enum"] == [kind.value for kind in LaneKind]
    assert _resolved(schema, properties["recipe"])["enum"] == [recipe.value for recipe in Recipe]
    assert _resolved(schema, properties["producer_mode"])["enum"] == [mode.value for mode in ProducerMode]
    variant, null = properties["native_variant"]["anyOf"]
    assert _resolved(schema, variant)["enum"] == [v.value for v in NativeVariant] and null == {"type": "null"}
    rule = _resolved(schema, properties["onboarding_qualification"])
    assert rule["properties"]["schema"]["enum"] == [recipe.onboarding_schema for recipe in Recipe]
    assert properties["rung"]["enum"] == sorted({recipe.rung for recipe in Recipe})


def test_every_schema_object_is_closed() -> None:
    """additionalProperties false on every object with properties; a union is closed by its branches."""
    for path in ("onboarding-identity.v1.schema.json", "lane-registry.v1.schema.json"):
        schema = json.loads((CONTRACTS_DIR / path).read_text())
        stack: list[tuple[str, Any]] = [("", schema)]
        objects = 0
        while stack:
            where, node = stack.pop()
            if isinstance(node, dict):
                if "properties" in node and "allOf" not in node:
                    objects += 1
                    assert node.get("additionalProperties") is False, f"{path}{where}"
                if "allOf" in node:
                    branches = [branch["then"]["$ref"].split("/")[-1] for branch in node["allOf"]]
                    for name in branches:
                        assert schema["$defs"][name]["additionalProperties"] is False
                stack.extend(
                    (f"{where}/{key}", value) for key, value in node.items() if key != "if"
                )
            elif isinstance(node, list):
                stack.extend((f"{where}[{i}]", value) for i, value in enumerate(node))
        assert objects > 1, path


def test_lane_table() -> None:
    assert set(LANES) == {
        "nvfp4-native-splitk",
        "nvfp4-native-f16",
        "nvfp4-native-w4a4",
        "nvfp4-exact",
        "kquant-exact-dflash",
        "kquant-exact",
        "kquant-native",
        "vllm-to-reference",
        "vllm-to-vllm",
        "vllm-via-connector",
        "reference-to-vllm",
        "transformers-cuda-fp32",
        "transformers-cuda-tf32",
        "transformers-cuda-bf16",
        "llama3-8b-shape-pd",
    }
    assert set(lanes.VLLM_LANE_ENGINES) == {n for n, s in LANES.items() if s.kind is LaneKind.VLLM}
    assert set(lanes.TRANSFORMERS_LANE_SETTINGS) == {
        n for n, s in LANES.items() if s.kind is LaneKind.TRANSFORMERS}
    assert {(s.device, s.dtype, s.tf32) for s in lanes.TRANSFORMERS_LANE_SETTINGS.values()} == {
        ("cuda", "float32", False), ("cuda", "float32", True), ("cuda", "bfloat16", False)}
    for name, spec in LANES.items():
        assert spec.name == name
        assert spec.recipe is recipe_for(spec.kind)
    assert LANES["kquant-exact-dflash"].speculative_draft
    assert LANES["kquant-exact-dflash"].recipe.rung == 3
    assert LANES["kquant-exact-dflash"].mode is ProducerMode.EXACT
    assert LANES["kquant-native"].mode is ProducerMode.NATIVE
    assert not LANES["kquant-exact"].speculative_draft and LANES["kquant-exact"].recipe.rung == 3
    assert LANES["kquant-exact"].mode is ProducerMode.EXACT and LANES["kquant-exact"].enrollable
    assert not LANES["nvfp4-exact"].enrollable and not LANES["kquant-native"].enrollable
    assert {spec.variant for spec in LANES.values() if spec.kind is LaneKind.NVFP4} == {
        *NativeVariant, None
    }


def test_default_native_text_lane_is_an_enrollable_native_text_lane() -> None:
    spec = LANES[DEFAULT_NATIVE_TEXT_LANE]
    assert spec.recipe is Recipe.NATIVE_TEXT
    assert spec.mode is ProducerMode.NATIVE
    assert spec.enrollable


def test_lane_table_and_specs_are_immutable() -> None:
    with pytest.raises(TypeError):
        LANES["rogue"] = LANES["nvfp4-exact"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        LANES["nvfp4-exact"].enrollable = True  # type: ignore[misc]


def test_unknown_lane_name_is_refused() -> None:
    with pytest.raises(Refused, match="lane: found 'vllm-native', expected one of nvfp4-native-splitk"):
        lane_spec("vllm-native")
    assert lane_spec("nvfp4-exact") is LANES["nvfp4-exact"]


def test_native_lane_cannot_declare_speculative_draft() -> None:
    with pytest.raises(Refused) as caught:
        LaneSpec("kquant-native-draft", LaneKind.KQUANT, Recipe.KQUANT_TARGET_PLUS_DFLASH,
                 ProducerMode.NATIVE, None, speculative_draft=True)
    message = str(caught.value)
    assert "native-mode lane cannot declare speculative-draft geometry" in message
    assert "drop the draft" in message and "kquant-exact-dflash" in message
    check_speculative_draft("x", ProducerMode.EXACT, True)
    check_speculative_draft("x", ProducerMode.NATIVE, False)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(kind=LaneKind.NVFP4, recipe=Recipe.KQUANT_TARGET_PLUS_DFLASH, mode=ProducerMode.EXACT,
              variant=None, speculative_draft=False), "qualifies under native-text"),
        (dict(kind=LaneKind.NVFP4, recipe=Recipe.NATIVE_TEXT, mode=ProducerMode.EXACT,
              variant=NativeVariant.F16, speculative_draft=False), "exact-mode lane has none"),
        (dict(kind=LaneKind.NVFP4, recipe=Recipe.NATIVE_TEXT, mode=ProducerMode.NATIVE,
              variant=None, speculative_draft=False), "must name its variant"),
        (dict(kind=LaneKind.KQUANT, recipe=Recipe.KQUANT_TARGET_PLUS_DFLASH, mode=ProducerMode.NATIVE,
              variant=NativeVariant.W4A4, speculative_draft=False), "nvfp4 contractions"),
        (dict(kind=LaneKind.NVFP4, recipe=Recipe.NATIVE_TEXT, mode=ProducerMode.EXACT,
              variant=None, speculative_draft=True), "only rung-3 recipes"),
        (dict(kind="nvfp4", recipe=Recipe.NATIVE_TEXT, mode=ProducerMode.EXACT,
              variant=None, speculative_draft=False), "expected a LaneKind"),
        (dict(kind=LaneKind.NVFP4, recipe=Recipe.NATIVE_TEXT, mode="native",
              variant=None, speculative_draft=False), "expected exact or native"),
    ],
)
def test_inconsistent_lane_specs_are_refused(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(Refused, match=fragment):
        LaneSpec("test-lane", **kwargs)  # type: ignore[arg-type]


def test_cache_identities_of_all_lanes_differ() -> None:
    identities = {name: target_cache_identity(spec, CHECKPOINT, "abi-1") for name, spec in LANES.items()}
    assert len(set(identities.values())) == len(LANES)
    kinds = [(spec.kind, spec.mode, spec.variant, lanes.VLLM_LANE_ENGINES.get(spec.name),
              lanes.TRANSFORMERS_LANE_SETTINGS.get(spec.name), spec.speculative_draft,
              spec.name == lanes.VLLM_VIA_CONNECTOR_LANE) for spec in LANES.values()]
    assert len(set(kinds)) == len(kinds), "two lanes would share a cache identity"
    exact = LANES["nvfp4-exact"]
    native = LANES["nvfp4-native-splitk"]
    assert target_cache_identity(exact, CHECKPOINT, "abi-1") != target_cache_identity(native, CHECKPOINT, "abi-1")


def test_cache_identity_is_canonical_and_input_sensitive() -> None:
    spec = LANES["nvfp4-native-splitk"]
    base = target_cache_identity(spec, CHECKPOINT, "abi-1")
    assert base == target_cache_identity(spec, dict(reversed(list(CHECKPOINT.items()))), "abi-1")
    assert base != target_cache_identity(spec, CHECKPOINT, "abi-2")
    changed = dict(CHECKPOINT, **{"config.json": sha256_bytes(b"other")})
    assert base != target_cache_identity(spec, changed, "abi-1")
    assert base != target_cache_identity(spec, {**CHECKPOINT, "extra.bin": sha256_bytes(b"x")}, "abi-1")


@pytest.mark.parametrize(
    ("digests", "abi", "fragment"),
    [
        ({"config.json": "0" * 64}, "abi", "non-zero 64-character lowercase hex"),
        ({"config.json": "TODO"}, "abi", "non-zero 64-character lowercase hex"),
        ({"config.json": sha256_bytes(b"x").upper()}, "abi", "lowercase hex"),
        ({}, "abi", "non-empty mapping"),
        (CHECKPOINT, "", "engine abi"),
        (CHECKPOINT, "   ", "engine abi"),
    ],
)
def test_cache_identity_refuses_placeholders(digests: dict[str, str], abi: str, fragment: str) -> None:
    with pytest.raises(Refused, match=fragment):
        target_cache_identity(LANES["nvfp4-exact"], digests, abi)


HEX = st.binary(min_size=32, max_size=32).map(bytes.hex).filter(lambda d: d != "0" * 64)
RELPATHS = st.sampled_from(
    ["config.json", "model.safetensors", "nvfp4/config.json", "nvfp4/model.safetensors",
     "gguf/target-q8_0.gguf", "gguf/eagle1-draft-q8_0.gguf", "tokenizer.json"]
)
ABIS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._", min_size=1, max_size=16)


@settings(max_examples=500, derandomize=True, deadline=None, database=None)
@given(
    digests=st.dictionaries(RELPATHS, HEX, min_size=1, max_size=5),
    other_digests=st.dictionaries(RELPATHS, HEX, min_size=1, max_size=5),
    abi=ABIS,
    other_abi=ABIS,
)
def test_cache_identities_never_collide(
    digests: dict[str, str], other_digests: dict[str, str], abi: str, other_abi: str
) -> None:
    """Across lanes, checkpoints and ABIs: equal identities only for equal inputs."""
    seen: dict[str, tuple[str, tuple[tuple[str, str], ...], str]] = {}
    for spec in LANES.values():
        for files, engine_abi in ((digests, abi), (other_digests, other_abi)):
            key = (
                f"{spec.kind.value}/{spec.mode.value}/{spec.variant}",
                tuple(sorted(files.items())),
                engine_abi,
            )
            identity = target_cache_identity(spec, files, engine_abi)
            assert seen.setdefault(identity, key) == key


def test_lanes_module_exports_typed_api() -> None:
    for name in ("LaneKind", "Recipe", "ProducerMode", "NativeVariant", "LaneSpec", "LANES",
                 "DEFAULT_NATIVE_TEXT_LANE", "recipe_for", "target_cache_identity", "lane_spec",
                 "check_speculative_draft"):
        assert hasattr(lanes, name)


def test_type_checker_rejects_a_lane_kind_without_a_recipe(tmp_path: Path) -> None:
    """Adds a LaneKind member to a copy of lanes.py and type-checks it (needs mypy installed)."""
    mypy_api = pytest.importorskip("mypy.api", reason="mypy is not installed in this environment")
    source = Path(lanes.__file__).read_text(encoding="utf-8")
    installed = Path(lanes.__file__).parents[1]
    package = tmp_path / "qualify"
    for relpath in ("__init__.py", "core/__init__.py", "core/digests.py", "core/errors.py", "contract/__init__.py"):
        (package / relpath).parent.mkdir(parents=True, exist_ok=True)
        (package / relpath).write_text((installed / relpath).read_text(encoding="utf-8"), encoding="utf-8")
    lanes_copy = package / "contract" / "lanes.py"
    lanes_copy.write_text(source, encoding="utf-8")
    clean = mypy_api.run([str(lanes_copy), "--no-incremental", "--cache-dir", os.devnull])
    assert clean[2] == 0, clean[0]
    extended = source.replace('    KQUANT = "kquant"\n', '    KQUANT = "kquant"\n    ONNX = "onnx"\n', 1)
    assert extended != source
    lanes_copy.write_text(extended, encoding="utf-8")
    report, _, status = mypy_api.run([str(lanes_copy), "--no-incremental", "--cache-dir", os.devnull])
    assert status != 0 and "assert_never" in report, report
