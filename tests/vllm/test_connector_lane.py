"""The KV connectors users deploy, at engine level: resolved by name, observed without being
trusted, run as a producer/consumer pair of real vLLM engines, and faults caught and localised.

One vLLM engine per process: the pair's producer and consumer are subprocesses
(:mod:`qualify.engines.connector_pair`). The module runs three engine processes: an
ExampleConnector producer, a consumer of it, and a consumer through the fault-injecting wrapper
over the same storage, which runs one branch per fault.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import pytest
import rfc8785

from qualify.contract.lanes import VLLM_BLOCK_SIZE
from qualify.core import assets
from qualify.core.errors import Refused
from qualify.engines import connector_faults, connector_pair
from qualify.engines.checkpoint import load_config
from qualify.engines.connector_under_test import ConnectorSpec, parse_connector_config, resolve_connector
from qualify.interfaces import connector_pair_command

PROMPT_TOKENS = len(assets.load_prompt())
HANDED_OFF = ((PROMPT_TOKENS - 1) // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
"""ExampleConnector hands off the whole blocks before the prompt's last token (1920 of 2048)."""
GEOMETRY = load_config(assets.MODEL_DIR).geometry


def _refusal(call, *args, **kwargs) -> str:
    with pytest.raises(Refused) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


# -- resolving the connector under test (no engine) -------------------------------------------


def test_a_registered_connector_is_pinned_to_vllms_distribution_and_its_config_digest():
    from qualify.engines.vllm_engine import VLLM_PIN, installed_vllm_version

    config = {"shared_storage_path": "/srv/kv", "retries": 3, "ratio": 0.5}
    spec = resolve_connector("ExampleConnector", config=config)
    assert spec.registered and spec.module_path is None
    assert spec.class_name == "ExampleConnector" and spec.module.startswith("vllm.")
    assert (spec.version, installed_vllm_version()) == (VLLM_PIN, VLLM_PIN)
    assert importlib.metadata.version(spec.package) == VLLM_PIN
    assert spec.config == config
    assert spec.config_sha256 == hashlib.sha256(rfc8785.dumps(config)).hexdigest()
    # Key order is not part of the config: the digest is over RFC 8785 bytes.
    reordered = resolve_connector("ExampleConnector", config=dict(reversed(list(config.items()))))
    assert reordered.config_sha256 == spec.config_sha256
    assert resolve_connector("ExampleConnector", config={**config, "retries": 4}).config_sha256 != spec.config_sha256
    assert spec.transfer_arguments() == {"kv_connector": "ExampleConnector", "kv_connector_module_path": None,
                                         "kv_connector_extra_config": config}


def test_a_connector_class_in_a_module_is_pinned_to_the_modules_distribution():
    spec = resolve_connector("FaultInjectingConnector", module="qualify.engines.connector_faults")
    assert not spec.registered and spec.module_path == "qualify.engines.connector_faults"
    assert spec.package == "trust-ladder"
    assert spec.version == importlib.metadata.version("trust-ladder")
    assert spec.config == {} and spec.config_sha256 == hashlib.sha256(b"{}").hexdigest()


def test_bad_connector_names_modules_and_classes_are_refused_in_one_line(tmp_path, monkeypatch):
    assert "NoSuchConnector" in _refusal(resolve_connector, "NoSuchConnector")
    assert "no_such_package.kv" in _refusal(resolve_connector, "X", module="no_such_package.kv")
    assert "../evil.py" in _refusal(resolve_connector, "X", module="../evil.py")
    assert "VllmEngine" in _refusal(resolve_connector, "VllmEngine", module="qualify.engines.vllm_engine")
    assert "NoSuchClass" in _refusal(resolve_connector, "NoSuchClass", module="qualify.engines.connector_faults")
    assert "KVConnectorBase_V1" in _refusal(resolve_connector, "KVConnectorBase_V1",
                                            module="vllm.distributed.kv_transfer.kv_connector.v1.base")
    # A module that raises while importing, and a connector module no installed distribution
    # owns (its version would be unknown).
    (tmp_path / "broken_connector.py").write_text("raise RuntimeError('boom at import')\n", encoding="utf-8")
    (tmp_path / "loose_connector.py").write_text(
        "from qualify.engines.connector_faults import FaultInjectingConnector\n"
        "class LooseConnector(FaultInjectingConnector):\n    pass\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "boom at import" in _refusal(resolve_connector, "Anything", module="broken_connector")
    assert "loose_connector" in _refusal(resolve_connector, "LooseConnector", module="loose_connector")
    assert "''" in _refusal(resolve_connector, "")


@pytest.mark.parametrize("text", ["[1, 2]", "\"a string\"", "null", "3", "not json", '{"a": 1, "a": 2}',
                                  '{"a": NaN}', '{"a": 1'])
def test_a_connector_config_that_is_not_a_json_object_is_refused_in_one_line(text):
    assert "connector config" in _refusal(parse_connector_config, text)


def test_a_config_is_a_json_object():
    assert parse_connector_config('{"shared_storage_path": "/kv", "n": [1, 2]}') == {
        "shared_storage_path": "/kv", "n": [1, 2]}
    assert parse_connector_config(None) == {}


def test_an_engine_process_refuses_a_connector_that_resolves_differently_from_its_pin(tmp_path, capsys):
    """The engine process re-resolves the pinned spec before building an engine: a spec whose
    config digest (or version, or class) is not what this process resolves exits 2 in one line."""
    pinned = resolve_connector("ExampleConnector", config={"shared_storage_path": str(tmp_path)}).as_dict()
    for field, value in (("config_sha256", "0" * 64), ("version", "0.0.1"), ("class", "Other")):
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps({**pinned, field: value}), encoding="utf-8")
        assert connector_pair_command.main(["producer", "--connector", str(path), "--out", str(tmp_path / "out")]) == 2
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("refused: ") and field in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_the_wrapper_forwards_every_method_of_the_connector_api():
    """A connector method the wrapper did not override would run the base class's no-op instead
    of the connector under test: every public method and property of vLLM's KVConnectorBase_V1
    is defined by the delegating wrapper itself."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from qualify.engines.connector_delegate import DelegatingConnector

    api = {name for name in dir(KVConnectorBase_V1) if not name.startswith("_")}
    assert len(api) > 30
    assert sorted(api - {"role"} - set(vars(DelegatingConnector))) == []


# -- the pair: ExampleConnector between two engines ---------------------------------------------


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> tuple[ConnectorSpec, Path, Path]:
    """ExampleConnector's spec, the producer's saved digests and its storage folder."""
    work = tmp_path_factory.mktemp("example-pair")
    storage = work / "storage"
    spec = resolve_connector("ExampleConnector", config={"shared_storage_path": str(storage)})
    return spec, connector_pair.run_producer(spec, work), storage


@pytest.fixture(scope="module")
def example_result(example, tmp_path_factory) -> connector_pair.PairResult:
    spec, saved, _ = example
    return connector_pair.run_consumer(spec, saved, tmp_path_factory.mktemp("example-consumer"))


@pytest.fixture(scope="module")
def fault_result(example, tmp_path_factory) -> connector_pair.PairResult:
    spec, saved, _ = example
    faulty = resolve_connector("FaultInjectingConnector", module="qualify.engines.connector_faults",
                               config={"connector_under_test": spec.as_dict(), "fault": None})
    return connector_pair.run_consumer(faulty, saved, tmp_path_factory.mktemp("fault-consumer"),
                                       faults=tuple(connector_faults.FAULTS), label="faults")


def test_example_connector_hands_off_bit_exactly(example_result):
    """The consumer loads the producer's whole blocks and decodes the cold recompute's tokens with
    bit-identical raw logits; its loaded KV is bit-equal to its own cold prefill, block by block,
    and to what the producer handed the connector."""
    result = example_result
    assert result.connector["name"] == "ExampleConnector"
    assert result.saved_tokens == PROMPT_TOKENS
    assert result.suppressed_hit == HANDED_OFF  # the cold branch really was offered the hit
    assert result.layout_max_abs < 1e-4  # the page decode reproduces the reference engine's KV
    loaded = result.branch(connector_pair.LOADED_KEY)
    assert loaded.claimed_tokens == HANDED_OFF
    assert len(loaded.tokens) == connector_pair.DECODE_TOKENS and loaded.tokens == result.cold_tokens
    assert loaded.token_divergence is None
    assert loaded.logits_max_abs == 0.0 and loaded.logit_rows_equal
    assert loaded.kv_cells == [] and loaded.kv_localisation is None
    assert loaded.saved_mismatches == []


def test_what_the_observer_saw_saved_is_what_the_connector_stored(example):
    """ExampleConnector's files (one per layer, whole-block slot copies of the paged cache),
    decoded independently, digest to exactly the producer's observed saved digests."""
    import safetensors.torch

    from qualify.engines.connector_observer import block_digests
    from qualify.engines.vllm_connector import decode_blocks

    _, saved_path, storage = example
    saved = json.loads(saved_path.read_text(encoding="utf-8"))["saved_digests"]
    (folder,) = [p for p in storage.iterdir() if p.is_dir()]
    blocks = HANDED_OFF // VLLM_BLOCK_SIZE
    checked = 0
    for layer in range(GEOMETRY.layers):
        stored = safetensors.torch.load_file(folder / f"model.layers.{layer}.self_attn.attn.safetensors")["kv_cache"]
        assert stored.shape[0] == HANDED_OFF
        pages = stored.reshape(blocks, VLLM_BLOCK_SIZE, *stored.shape[1:]).permute(0, 2, 1, 3).contiguous()
        keys, values = decode_blocks(pages, list(range(blocks)), GEOMETRY.head_dim)
        for (lyr, tensor, head, block), digest in block_digests(layer, keys, values, VLLM_BLOCK_SIZE).items():
            assert saved[f"{lyr}/{tensor}/{head}/{block}"] == digest
            checked += 1
    assert checked == GEOMETRY.layers * 2 * GEOMETRY.kv_heads * blocks


# -- faults: caught and localised -----------------------------------------------------------------


def test_the_fault_wrapper_without_a_fault_changes_nothing(fault_result):
    loaded = fault_result.branch(connector_pair.LOADED_KEY)
    assert loaded.claimed_tokens == HANDED_OFF
    assert loaded.logit_rows_equal and loaded.kv_cells == [] and loaded.saved_mismatches == []


@pytest.mark.parametrize("fault", list(connector_faults.FAULTS))
def test_each_fault_is_caught_and_localised(fault_result, fault):
    """The loaded KV differs from the cold prefill in exactly the cells the fault touched (layer,
    K or V, KV head, block), the same cells differ from what the producer saved, and the decode's
    logits move."""
    branch = fault_result.branch(f"fault-{fault}")
    assert branch.claimed_tokens == HANDED_OFF
    expected = connector_faults.expected_footprint(fault, layers=GEOMETRY.layers, kv_heads=GEOMETRY.kv_heads,
                                                   loaded_blocks=HANDED_OFF // VLLM_BLOCK_SIZE)
    found = {(c["layer"], c["tensor"], c["head"], c["block"]) for c in branch.kv_cells}
    assert found == expected
    assert set(branch.saved_mismatches) == {f"{layer}/{tensor}/{head}/{block}" for layer, tensor, head, block in expected}
    assert not branch.logit_rows_equal and branch.logits_max_abs > 0
    first = branch.kv_localisation["first"] if branch.kv_localisation else None
    assert first is not None and (first["layer"], first["tensor"], first["head"], first["block"]) == min(
        expected, key=lambda cell: (cell[0], cell[1], cell[2], cell[3]))


def test_one_scaled_element_is_localised_to_its_position_and_dim(fault_result):
    from qualify.engines.connector_faults import (
        FAULT_BLOCK,
        FAULT_HEAD,
        FAULT_LAYER,
        SCALED_DIM,
        SCALED_POSITION_IN_BLOCK,
    )

    (cell,) = fault_result.branch("fault-element-scaled").kv_cells
    assert (cell["layer"], cell["tensor"], cell["head"], cell["block"]) == (FAULT_LAYER, "K", FAULT_HEAD, FAULT_BLOCK)
    assert cell["differing"] == 1
    assert (cell["first_position"], cell["first_dim"]) == (FAULT_BLOCK * VLLM_BLOCK_SIZE + SCALED_POSITION_IN_BLOCK,
                                                           SCALED_DIM)
    assert cell["max_abs"] > 0


def test_an_unknown_fault_is_refused():
    from qualify.engines.connector_delegate import WrapperRefused
    from qualify.engines.connector_faults import check_fault

    with pytest.raises(WrapperRefused, match="no-such-fault"):
        check_fault("no-such-fault")
    assert check_fault(None) is None and check_fault("stale-block") == "stale-block"
